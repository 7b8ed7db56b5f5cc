//! The differential test: on every real snapshot, the model replays the
//! trace as recorded and must make the segments the trace recorded itself,
//! at the same entries with the same sizes, and peak where the trace peaks.
//!
//! Files that cannot agree are listed here and in docs/whatif.md with the reason.

#![allow(clippy::print_stderr)]
use oomkit_allocator::{what_if, Options, Scenario};
use oomkit_snapshot::Snapshot;
use std::path::PathBuf;

/// Files that are not one allocator's record, with why.
const NOT_A_RUN: [(&str, &str); 2] = [
    (
        "snapviewer_sample.pickle",
        "SnapViewer's generated sample: its trace allocates at addresses that lie in none of its segments",
    ),
    (
        "demo_snapshot.pickle",
        "oomkit's own demo, written by scripts/make_demo_snapshot.py's simplified allocator (first fit, not best fit)",
    ),
];

fn files() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut v = vec![root.join("../oomkit-cli/assets/demo_snapshot.pickle")];
    for dir in [
        root.join("../../../shared/fixtures/snapshots"),
        root.join("../oomkit-cli/tests/real"),
        root.join("tests/gpu"),
    ] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            eprintln!("skipping {}: absent", dir.display());
            continue;
        };
        v.extend(entries.map(|e| e.unwrap().path()).filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("pickle" | "pkl")
            )
        }));
    }
    v.sort();
    v
}

#[test]
fn the_model_makes_the_segments_each_real_trace_recorded() {
    let mut failures = Vec::new();
    for f in files() {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        let snap = Snapshot::from_bytes(&std::fs::read(&f).unwrap()).unwrap();
        let w = what_if(&snap, &[], &Options::default()).unwrap();
        for d in &w.devices {
            let a = &d.agreement;
            let rec = &d.scenarios[0];
            eprintln!(
                "{name} cuda:{}: {} entries, {}/{} recorded segment allocations made ({:.1}%), {:.1}% of allocations at their recorded address, peak reserved {} (trace {}){}",
                d.device,
                d.events,
                a.matched,
                a.recorded,
                100.0 * a.share,
                100.0 * a.placed_at_recorded_address,
                rec.peak_reserved_bytes,
                d.recorded_peak_reserved_bytes,
                a.first_divergence
                    .as_ref()
                    .map(|x| format!("; first divergence at segment {}: trace {:?}, model {:?}", x.index, x.recorded, x.simulated))
                    .unwrap_or_default(),
            );
            if NOT_A_RUN.iter().any(|(n, _)| *n == name) {
                continue;
            }
            if a.share != 1.0 || a.placed_at_recorded_address != 1.0 || rec.unfollowed != 0 {
                failures.push(format!(
                    "{name} cuda:{}: {a:?}, {} unfollowed",
                    d.device, rec.unfollowed
                ));
            }
            if rec.peak_reserved_bytes != d.recorded_peak_reserved_bytes {
                failures.push(format!(
                    "{name} cuda:{}: peak reserved {} against the trace's {}",
                    d.device, rec.peak_reserved_bytes, d.recorded_peak_reserved_bytes
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn every_real_trace_replays_under_every_kind_of_scenario() {
    let scenarios = [
        Scenario::alloc_conf("expandable_segments:True"),
        Scenario::alloc_conf("max_split_size_mb:128,roundup_power2_divisions:4"),
        Scenario::capacity("T4").unwrap(),
        Scenario::batch_scale("0.5").unwrap(),
    ];
    for f in files() {
        let snap = Snapshot::from_bytes(&std::fs::read(&f).unwrap()).unwrap();
        let w = what_if(&snap, &scenarios, &Options::default()).unwrap();
        for d in &w.devices {
            let rec = &d.scenarios[0];
            for s in &d.scenarios {
                assert!(
                    s.peak_reserved_bytes >= s.peak_allocated_bytes,
                    "{}: {}",
                    f.display(),
                    s.name
                );
                assert!(s.free_in_segments_at_peak_bytes <= s.peak_reserved_bytes);
            }
            // Half the micro-batch asks for less, though the blocks it gets
            // can be a little larger than asked (a remainder of up to 1 MiB
            // stays with a large block), so allocated bytes may not fall.
            let half = d
                .scenarios
                .iter()
                .find(|s| s.batch_scale == Some(0.5))
                .unwrap();
            assert!(
                half.peak_allocated_bytes as f64 <= rec.peak_allocated_bytes as f64 * 1.01,
                "{}: {} > {}",
                f.display(),
                half.peak_allocated_bytes,
                rec.peak_allocated_bytes
            );
        }
    }
}

/// Under a capacity, no replay holds more than the capacity without an
/// OOM: on every real trace, at 90% of its peak allocated memory (where it
/// must run out) and halfway between its allocated and reserved memory
/// (where most warm traces fit once their cache goes back).
#[test]
fn no_scenario_holds_more_than_its_capacity_without_an_oom() {
    for f in files() {
        let snap = Snapshot::from_bytes(&std::fs::read(&f).unwrap()).unwrap();
        let w = what_if(&snap, &[], &Options::default()).unwrap();
        for d in &w.devices {
            let rec = &d.scenarios[0];
            if rec.peak_allocated_bytes < 16 << 20 {
                continue;
            }
            let below = rec.peak_allocated_bytes * 9 / 10;
            let between = rec.peak_allocated_bytes / 2 + rec.peak_reserved_bytes / 2;
            let scenarios = [
                Scenario::capacity(&below.to_string()).unwrap(),
                Scenario::capacity(&between.to_string()).unwrap(),
                Scenario::batch_scale("0.5").unwrap(),
            ];
            let opts = Options {
                device: Some(d.device),
                ..Options::default()
            };
            let w = what_if(&snap, &scenarios, &opts).unwrap();
            let name = f.file_name().unwrap().to_string_lossy().to_string();
            for s in &w.devices[0].scenarios {
                if let Some(cap) = s.capacity_bytes {
                    assert!(
                        s.peak_reserved_bytes <= cap || !s.oom_details.is_empty(),
                        "{name}: {} holds {} in {cap} with no OOM",
                        s.name,
                        s.peak_reserved_bytes
                    );
                }
            }
            let under = &w.devices[0].scenarios[2];
            assert!(
                !under.oom_details.is_empty(),
                "{name}: {} needs {} allocated at most, in {}, yet no OOM",
                under.name,
                rec.peak_allocated_bytes,
                below
            );
        }
    }
}
