//! Feeds arbitrary bytes through the pickle reader, the snapshot model and
//! the analyses: none of them may panic, hang or allocate without bound.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(doc) = oomkit_pickle::Document::parse(data) {
        let _ = doc.repr(doc.root(), 64);
        if let Ok(snap) = oomkit_snapshot::Snapshot::from_document(&doc) {
            let _ = oomkit_snapshot::analyze(&snap, &oomkit_snapshot::Options::default());
        }
    }
    // The streaming reader claims trace entries while parsing: a second path
    // through the parser that must be just as robust.
    if let Ok(snap) = oomkit_snapshot::Snapshot::from_bytes(data) {
        let a = oomkit_snapshot::analyze(&snap, &oomkit_snapshot::Options::default());
        // The report's chart of roles over time replays the trace again.
        for d in &a.devices {
            let _ = oomkit_snapshot::role_timeline(&snap, d.device, &[None]);
        }
    }
});
