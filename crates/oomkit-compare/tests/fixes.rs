//! The replayed fix written into an analysis: the demo snapshot, whose
//! memory stranded in segments is replayed with expandable segments (which
//! do not avoid its OOM) and with half the micro-batch (which does).

use oomkit_advice::FindingKind;
use oomkit_snapshot::Snapshot;

#[test]
fn the_fragmentation_finding_and_the_verdict_carry_the_replayed_fix() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../oomkit-cli/assets/demo_snapshot.pickle"
    );
    let snap = Snapshot::from_bytes(&std::fs::read(path).unwrap()).unwrap();
    let mut analysis = oomkit_snapshot::analyze(&snap, &oomkit_snapshot::Options::default());
    oomkit_compare::replay_fixes(&snap, &mut analysis);
    let f = analysis
        .findings
        .iter()
        .find(|f| f.kind == FindingKind::Fragmentation)
        .unwrap();
    let r = f.replayed.as_ref().unwrap();
    assert_eq!(r.oom_event, Some(7923));
    assert_eq!(r.oom_happens, Some(true));
    assert!(!r.helps);
    assert!(
        f.advice.starts_with("replayed with expandable_segments:True, the OOM at event 7923 still happens (peaks at 23.5 GiB reserved instead of 23.9 GiB (-426 MiB)): that setting does not fix it; with half the micro-batch it does not happen (peak 17.5 GiB reserved)"),
        "{}",
        f.advice
    );
}
