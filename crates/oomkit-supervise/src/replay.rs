//! Whether the allocator setting `oomkit run` would retry with fixes an
//! attempt's OOM, told by replaying the snapshot the attempt's tracker
//! dumped at it through the model of the caching allocator.

use oomkit_allocator::{what_if, Options, Scenario};
use oomkit_snapshot::Snapshot;
use std::path::Path;

/// What the replay of an attempt's snapshot said of a setting.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FixReplay {
    /// The OOM it is about: the last one the trace recorded, which ended the attempt.
    pub event: usize,
    /// False where the allocation still fails with the setting.
    pub avoided: bool,
    /// The peak reserved with the setting, and as recorded.
    pub peak_reserved_bytes: u64,
    /// The peak reserved as recorded.
    pub recorded_peak_reserved_bytes: u64,
}

/// Replays `snapshot` with the allocator settings `conf`; `None` where it
/// cannot be read, has no trace or no recorded OOM to judge by.
pub fn replay_fix(snapshot: &Path, conf: &str) -> Option<FixReplay> {
    let snap = Snapshot::load(snapshot, &mut |_, _| {}).ok()?;
    let w = what_if(&snap, &[Scenario::alloc_conf(conf)], &Options::default()).ok()?;
    let d = w.devices.iter().find(|d| {
        d.scenarios
            .first()
            .is_some_and(|s| !s.recorded_ooms.is_empty())
    })?;
    let (rec, fix) = (d.scenarios.first()?, d.scenarios.last()?);
    let last = fix.recorded_ooms.last()?;
    Some(FixReplay {
        event: last.event,
        avoided: !last.happens,
        peak_reserved_bytes: fix.peak_reserved_bytes,
        recorded_peak_reserved_bytes: rec.peak_reserved_bytes,
    })
}
