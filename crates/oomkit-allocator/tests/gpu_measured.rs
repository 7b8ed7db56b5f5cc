//! The model against PyTorch's allocator itself: traces recorded on an H200
//! (tests/gpu/SOURCES.md), replayed as recorded and under the settings the
//! other runs used, must give the figures `torch.cuda.memory_stats()`
//! measured in those runs, to the byte, and fail where they failed.

use oomkit_allocator::{what_if, Options, Scenario, ScenarioOut};
use oomkit_snapshot::Snapshot;
use serde_json::Value;
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/gpu")
}

/// Each run `measured.json` records, with the scenario that replays its trace.
fn runs() -> Vec<Value> {
    let text = std::fs::read_to_string(dir().join("measured.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["runs"].as_array().unwrap().clone()
}

/// The trace of `run` replayed under the settings of `run` (as recorded when it is the trace's own run).
fn replay(run: &Value) -> ScenarioOut {
    let file = dir().join(run["trace"].as_str().unwrap());
    let snap = Snapshot::from_bytes(&std::fs::read(&file).unwrap()).unwrap();
    let scenarios: Vec<Scenario> = run["replayed_under"]
        .as_str()
        .map(|conf| vec![Scenario::alloc_conf(conf)])
        .unwrap_or_default();
    let w = what_if(&snap, &scenarios, &Options::default()).unwrap();
    let [d] = w.devices.as_slice() else {
        panic!("{}: one device expected", file.display())
    };
    let s = d.scenarios.last().unwrap().clone();
    assert_eq!(s.unfollowed, 0, "{}", run["name"]);
    s
}

#[test]
fn each_run_and_each_prediction_is_what_the_allocator_measured() {
    let runs = runs();
    assert_eq!(runs.len(), 10);
    for run in &runs {
        let name = run["name"].as_str().unwrap();
        let s = replay(run);
        assert_eq!(
            s.peak_reserved_bytes,
            run["peak_reserved_bytes"].as_u64().unwrap(),
            "{name}: peak reserved"
        );
        assert_eq!(
            s.peak_allocated_bytes,
            run["peak_allocated_bytes"].as_u64().unwrap(),
            "{name}: peak allocated"
        );
        let oom = run["status"] == "oom";
        assert_eq!(!s.ooms.is_empty(), oom, "{name}: OOM {:?}", s.ooms);
        // Expandable segments map pages, which memory_stats does not count
        // as segments; a capped run counts one more, the context's first
        // allocation, made and given back before recording began.
        if let (false, Some(counted)) = (
            s.settings.contains("expandable_segments:True"),
            run["segments_allocated"].as_u64(),
        ) {
            let before = u64::from(!run["capacity_bytes"].is_null());
            assert_eq!(
                s.segments.len() as u64,
                counted - before,
                "{name}: segments"
            );
        }
    }
}

#[test]
fn the_recorded_ooms_happen_at_the_entry_the_trace_recorded() {
    for run in runs()
        .iter()
        .filter(|r| r["status"] == "oom" && r.get("replayed_under").is_none())
    {
        let s = replay(run);
        let [recorded] = s.recorded_ooms.as_slice() else {
            panic!("{}: one recorded OOM expected", run["name"])
        };
        assert!(recorded.happens);
        assert_eq!(s.ooms.first(), Some(&recorded.event), "{}", run["name"]);
    }
}

#[test]
fn an_oom_under_the_process_s_own_cap_is_not_replayed_as_the_device_s() {
    // set_per_process_memory_fraction(0.25) on the H200: 12.3 GiB asked for
    // with 114 GiB free on the device. The capacity the trace implies for a
    // device OOM (reserved plus free, 139 GiB) would make the OOM vanish from
    // the replay and every setting look like a fix.
    let snap = Snapshot::from_bytes(
        &std::fs::read(dir().join("h200_gpt124m_fraction_oom.pickle")).unwrap(),
    )
    .unwrap();
    let w = what_if(
        &snap,
        &[Scenario::alloc_conf("expandable_segments:True")],
        &Options::default(),
    )
    .unwrap();
    let d = &w.devices[0];
    for s in &d.scenarios {
        assert_eq!(s.capacity_source, "process_limit", "{}", s.name);
        // Replayed at the most it had held: the OOM happens there under either setting.
        assert!(s.recorded_ooms.iter().all(|o| o.happens), "{}", s.name);
    }
    assert_eq!(d.agreement.share, 1.0);
    assert!(
        d.notes
            .iter()
            .any(|n| n.contains("the limit was the process's own")),
        "{:?}",
        d.notes
    );
    let a = oomkit_snapshot::analyze(&snap, &Default::default());
    assert_eq!(
        a.devices[0].ooms[0].cause,
        oomkit_advice::Cause::MemoryFractionLimit
    );
}
