//! The fix the analysis recommends for fragmentation, checked by replay
//! through the allocator model (`oomkit-allocator`, which computes figures
//! and says nothing in words; the words are here):
//! the trace is replayed with expandable segments, and the finding (and
//! the verdict, where the OOM is fragmentation's) says what that did, with
//! figures; where it does not help, it says so and what the replay found
//! that does.

use oomkit_advice::{Cause, FindingKind, Replayed};
use oomkit_allocator::{what_if, DeviceWhatIf, Options, Scenario, ScenarioOut, StartKind};
use oomkit_snapshot::{Analysis, Snapshot};
use oomkit_units::{human_bytes, human_delta};

/// The setting a fragmentation finding recommends.
const FIX: &str = "expandable_segments:True";
/// The micro-batch share tried where the setting does not avoid an OOM.
const SMALLER_BATCH: &str = "0.5";
/// Peaks closer than this share read as the same: three digits of a report cannot tell them apart.
pub const SAME_PEAK: f64 = 0.005;

/// "peaks at X reserved instead of Y (delta)", or "at about the same" where three digits cannot tell them apart.
pub fn peak_words(with: u64, base: u64) -> String {
    let delta = with as i64 - base as i64;
    if (delta.unsigned_abs() as f64) < SAME_PEAK * base as f64 {
        format!(
            "peaks at about the same reserved ({}, {})",
            human_bytes(with),
            human_delta(delta)
        )
    } else {
        format!(
            "peaks at {} reserved instead of {} ({})",
            human_bytes(with),
            human_bytes(base),
            human_delta(delta)
        )
    }
}

/// Replays the trace of each device with a fragmentation finding (an OOM
/// of that cause, or memory stranded in segments) with expandable segments
/// and writes what that did into the finding and the verdict.
pub fn replay_fixes(snap: &Snapshot, analysis: &mut Analysis) {
    let mut devices: Vec<i64> = analysis
        .findings
        .iter()
        .filter(|f| {
            matches!(
                f.kind,
                FindingKind::OomFragmentation | FindingKind::Fragmentation
            )
        })
        .filter_map(|f| f.device)
        .filter(|&d| !snap.events(d).is_empty())
        .collect();
    devices.sort_unstable();
    devices.dedup();
    let expandable_on = analysis
        .allocator_settings
        .as_ref()
        .and_then(|s| s.get("expandable_segments"))
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    if expandable_on {
        // The fix recommended then is empty_cache() before the failing
        // phase, which the trace cannot place.
        return;
    }
    for device in devices {
        let opts = Options {
            device: Some(device),
            samples: Vec::new(),
            no_baseline: false,
        };
        let Ok(w) = what_if(snap, &[Scenario::alloc_conf(FIX)], &opts) else {
            continue;
        };
        let Some(d) = w.devices.first() else { continue };
        let needs_alternative = d
            .scenarios
            .last()
            .is_some_and(|s| s.recorded_ooms.iter().any(|r| r.happens));
        let smaller = needs_alternative
            .then(|| {
                let s = Scenario::batch_scale(SMALLER_BATCH).ok()?;
                what_if(snap, &[s], &opts).ok()
            })
            .flatten();
        let smaller = smaller.as_ref().and_then(|w| w.devices.first());
        amend(analysis, d, smaller);
    }
}

/// Writes the replay of one device into its fragmentation findings and the verdict.
fn amend(analysis: &mut Analysis, d: &DeviceWhatIf, smaller: Option<&DeviceWhatIf>) {
    let (Some(rec), Some(fix)) = (d.scenarios.first(), d.scenarios.last()) else {
        return;
    };
    let base = match fix.start {
        StartKind::Fresh => d
            .scenarios
            .iter()
            .find(|s| s.start == StartKind::Fresh && s.name != fix.name)
            .unwrap_or(rec),
        StartKind::AsRecorded => rec,
    };
    let model = if d.agreement.share < 1.0 || d.agreement.placed_at_recorded_address < 1.0 {
        " (the model parts from the trace's own segments, so the figures are the model's more than the run's)"
    } else {
        ""
    };
    for f in analysis
        .findings
        .iter_mut()
        .filter(|f| f.device == Some(d.device))
    {
        let oom = match f.kind {
            FindingKind::OomFragmentation => f.event.map(|e| e as usize),
            // Memory stranded on a device that ran out: whether the setting
            // avoids that OOM is what matters most.
            FindingKind::Fragmentation => rec.recorded_ooms.first().map(|r| r.event),
            _ => continue,
        };
        let r = replayed(d, fix, base, oom, smaller);
        f.advice = format!("{}{model}", words(&r, &f.advice));
        f.replayed = Some(r);
    }
    let v = &mut analysis.verdict;
    let on_device = v.place.device.as_deref() == Some(format!("cuda:{}", d.device).as_str());
    if v.failed && v.cause == Some(Cause::Fragmentation) && on_device {
        let r = replayed(d, fix, base, v.place.event.map(|e| e as usize), smaller);
        let fixed = format!("{}{model}", words(&r, v.fix.as_deref().unwrap_or("")));
        v.detail = v
            .detail
            .replace(v.fix.as_deref().unwrap_or("\u{0}"), &fixed);
        v.fix = Some(fixed);
    }
}

/// The figures of the fix for one finding.
fn replayed(
    d: &DeviceWhatIf,
    fix: &ScenarioOut,
    base: &ScenarioOut,
    oom: Option<usize>,
    smaller: Option<&DeviceWhatIf>,
) -> Replayed {
    let happens = oom.and_then(|e| {
        fix.recorded_ooms
            .iter()
            .find(|r| r.event == e)
            .map(|r| r.happens)
    });
    let lowered =
        (fix.peak_reserved_bytes as f64) < (1.0 - SAME_PEAK) * base.peak_reserved_bytes as f64;
    let helps = match happens {
        Some(h) => !h,
        None => lowered,
    };
    let alternative = match (happens, oom, smaller.and_then(|s| s.scenarios.last())) {
        (Some(true), Some(e), Some(half)) => Some(
            match half.recorded_ooms.iter().find(|r| r.event == e) {
                Some(r) if !r.happens => format!(
                    "with half the micro-batch it does not happen (peak {} reserved): lower the micro-batch and raise gradient accumulation to keep the effective batch (`oomkit run` does both)",
                    human_bytes(half.peak_reserved_bytes)
                ),
                _ => "even half the micro-batch runs out there: what is held for the whole run (parameters, gradients, optimizer state) does not fit beside the step; shard or offload it, or use a larger GPU (`oomkit whatif --capacity` says which is enough)".into(),
            },
        ),
        _ => None,
    };
    Replayed {
        settings: fix.settings.clone(),
        peak_reserved_bytes: fix.peak_reserved_bytes,
        baseline_peak_reserved_bytes: base.peak_reserved_bytes,
        oom_event: oom,
        oom_happens: happens,
        helps,
        alternative,
        model_agreement: d.agreement.share,
    }
}

/// The advice with the replay's figures in front; where the fix does not
/// help, the replay's word instead of the rule of thumb.
fn words(r: &Replayed, advice: &str) -> String {
    let peak = peak_words(r.peak_reserved_bytes, r.baseline_peak_reserved_bytes);
    match (r.oom_event, r.oom_happens) {
        (Some(e), Some(false)) => format!(
            "replayed with {}, the OOM at event {e} does not happen and this trace {peak} (oomkit whatif): {advice}",
            r.settings
        ),
        (Some(e), Some(true)) => format!(
            "replayed with {}, the OOM at event {e} still happens ({peak}): that setting does not fix it; {}",
            r.settings,
            r.alternative.as_deref().unwrap_or("lower the micro-batch and raise gradient accumulation to keep the effective batch (`oomkit run` does both)")
        ),
        _ if r.helps => format!("replayed with {}, this trace {peak} (oomkit whatif): {advice}", r.settings),
        _ => format!(
            "replayed with {}, this trace {peak}: that setting would not lower it, the free pieces are cache this program reuses, and nothing needs changing",
            r.settings
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(oom_happens: Option<bool>, with: u64, base: u64, alternative: Option<&str>) -> Replayed {
        Replayed {
            settings: FIX.into(),
            peak_reserved_bytes: with,
            baseline_peak_reserved_bytes: base,
            oom_event: oom_happens.map(|_| 7923),
            oom_happens,
            helps: oom_happens == Some(false) || with < base,
            alternative: alternative.map(String::from),
            model_agreement: 1.0,
        }
    }

    #[test]
    fn where_the_fix_does_not_help_the_advice_says_so_and_what_does() {
        let gib = 1u64 << 30;
        let still = words(
            &r(
                Some(true),
                23 * gib,
                24 * gib,
                Some("with half the micro-batch it does not happen"),
            ),
            "set it",
        );
        assert!(still.starts_with("replayed with expandable_segments:True, the OOM at event 7923 still happens (peaks at 23.0 GiB reserved instead of 24.0 GiB (-1.00 GiB)): that setting does not fix it; with half the micro-batch"), "{still}");
        assert!(!still.contains("set it"));
        let cache = words(&r(None, 24 * gib, 24 * gib, None), "set it");
        assert!(
            cache.contains("would not lower it") && !cache.contains("set it"),
            "{cache}"
        );
        let helps = words(&r(None, 20 * gib, 24 * gib, None), "set it");
        assert!(helps.ends_with("(oomkit whatif): set it"), "{helps}");
        let avoided = words(&r(Some(false), 24 * gib, 24 * gib, None), "set it");
        assert_eq!(avoided, "replayed with expandable_segments:True, the OOM at event 7923 does not happen and this trace peaks at about the same reserved (24.0 GiB, +0 B) (oomkit whatif): set it");
    }

    #[test]
    fn peaks_three_digits_cannot_tell_apart_read_as_the_same() {
        assert_eq!(
            peak_words(1000 << 20, 1001 << 20),
            "peaks at about the same reserved (1000 MiB, -1.00 MiB)"
        );
        assert!(peak_words(900 << 20, 1000 << 20)
            .starts_with("peaks at 900 MiB reserved instead of 1000 MiB"));
    }
}
