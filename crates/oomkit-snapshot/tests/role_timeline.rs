//! The chart stacked by role adds up to the replayed active bytes at every
//! point, on every real snapshot and on the demo.

#![allow(clippy::print_stderr)]
use oomkit_snapshot::{analyze, role_timeline, timeline, Options, Snapshot};
use std::path::PathBuf;

fn files() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut v = vec![root.join("../oomkit-cli/assets/demo_snapshot.pickle")];
    for dir in [
        root.join("../../../shared/fixtures/snapshots"),
        root.join("../oomkit-cli/tests/real"),
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
    v
}

#[test]
fn roles_over_time_add_up_to_the_active_bytes() {
    for f in files() {
        let snap = Snapshot::from_bytes(&std::fs::read(&f).unwrap()).unwrap();
        let analysis = analyze(&snap, &Options::default());
        // Without a trace there is no chart.
        for d in analysis.devices.iter().filter(|d| d.events > 0) {
            let tl = timeline(&snap, d, 0);
            let at: Vec<Option<u64>> = tl.points.iter().map(|p| p.after_event).collect();
            let (series, roles) = role_timeline(&snap, d.device, &at);
            assert_eq!(series.len(), tl.points.len(), "{}", f.display());
            assert_eq!(roles.len(), tl.points.len(), "{}", f.display());
            // Every allocation adds to a role; the start adds to none.
            let events = snap.events(d.device);
            for (p, r) in tl.points.iter().zip(&roles) {
                match p.after_event {
                    None => assert_eq!(*r, None),
                    Some(i) if events[i as usize].action == oomkit_snapshot::Action::Alloc => {
                        assert!(r.is_some(), "{}", f.display())
                    }
                    Some(_) => {}
                }
            }
            for (p, r) in tl.points.iter().zip(&series) {
                assert_eq!(
                    r.total(),
                    p.active_bytes,
                    "{} cuda:{} after {:?}",
                    f.display(),
                    d.device,
                    p.after_event
                );
            }
            // At the peak the chart shows the roles the report counts,
            // except frameless allocations made in the trace.
            if let Some(i) = d.peak_event_index {
                let k = at.iter().position(|a| *a == Some(i)).unwrap();
                assert_eq!(
                    series[k].parameters,
                    d.roles.peak.parameters,
                    "{}",
                    f.display()
                );
                assert_eq!(
                    series[k].gradients,
                    d.roles.peak.gradients,
                    "{}",
                    f.display()
                );
                assert_eq!(
                    series[k].optimizer_state,
                    d.roles.peak.optimizer_state,
                    "{}",
                    f.display()
                );
            }
        }
    }
}
