//! The verdict that heads every report: what failed, where, why, and the
//! first fix with its number; for a run that did not fail, its peak and the
//! most important finding.

use crate::cause::{Cause, Figures};
use crate::finding::{Finding, FindingKind};
use crate::role::Role;
use oomkit_units::human_bytes;
use serde::Serialize;

/// Where a failure happened, as precisely as the source says.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Place {
    /// `cuda:N` or `cpu`.
    pub device: Option<String>,
    /// The rank, for run logs and several files.
    pub rank: Option<u32>,
    /// The snapshot's trace entry.
    pub event: Option<u64>,
    /// The training step, for run logs.
    pub step: Option<u64>,
    /// The stage or phase that was running (`forward`, `backward`, `optimizer`, `eval`, a `record_function` name).
    pub stage: Option<String>,
}

impl Place {
    /// "on rank 1 (cuda:1) in backward of step 3", from what is known.
    fn text(&self) -> String {
        let mut s = String::new();
        match (self.rank, &self.device) {
            (Some(r), Some(d)) => s.push_str(&format!("on rank {r} ({d})")),
            (Some(r), None) => s.push_str(&format!("on rank {r}")),
            (None, Some(d)) => s.push_str(&format!("on {d}")),
            (None, None) => {}
        }
        let when = match (&self.stage, self.step, self.event) {
            (Some(st), Some(n), _) => Some(format!("in {st} of step {n}")),
            (Some(st), None, Some(e)) => Some(format!("at event {e}, in {st}")),
            (Some(st), None, None) => Some(format!("in {st}")),
            (None, Some(n), _) => Some(format!("in step {n}")),
            (None, None, Some(e)) => Some(format!("at event {e}")),
            (None, None, None) => None,
        };
        if let Some(w) = when {
            if !s.is_empty() {
                s.push(' ');
            }
            s.push_str(&w);
        }
        s
    }
}

/// The one or two lines a report starts with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// True when the file records an out-of-memory error.
    pub failed: bool,
    /// The first line: what failed and where, or the peak of a healthy run.
    pub headline: String,
    /// The second line: the cause and the first fix, or the most important finding.
    pub detail: String,
    /// Where it failed (empty for a healthy run).
    pub place: Place,
    /// Bytes the failing request asked for.
    pub requested_bytes: Option<u64>,
    /// The line of code that asked, where known.
    pub site: Option<String>,
    /// Why it failed.
    pub cause: Option<Cause>,
    /// The first thing to change, with its number.
    pub fix: Option<String>,
    /// The peak, for a healthy run.
    pub peak_bytes: Option<u64>,
    /// The most important finding of a healthy run, if any.
    pub finding: Option<FindingKind>,
    /// The role holding the most memory at the failure (or at the peak of
    /// a healthy run), where the source tells roles.
    pub role: Option<Role>,
}

/// What is known about one OOM, from any source.
#[derive(Clone, Debug, Default)]
pub struct Failure {
    /// Where it happened.
    pub place: Place,
    /// The allocator's figures at the failing request.
    pub figures: Figures,
    /// Bytes held by live tensors then.
    pub live: Option<u64>,
    /// The line of code that asked.
    pub site: Option<String>,
    /// Whether expandable segments were already on.
    pub expandable_segments: bool,
    /// The role holding the most of what was live then, with its bytes.
    pub largest_role: Option<(Role, u64)>,
}

impl Verdict {
    /// The verdict on a failure: its place, request, site, cause and first fix.
    pub fn failed(f: &Failure, cause: Cause) -> Verdict {
        Verdict::failed_with_fix(f, cause, first_fix(cause, f))
    }

    /// The verdict on a failure with the first fix given, where the source
    /// knows a better one than the cause alone gives (the library that failed).
    pub fn failed_with_fix(f: &Failure, cause: Cause, fix: String) -> Verdict {
        let asked = f
            .figures
            .requested
            .map(|r| format!("; {} requested", human_bytes(r)))
            .unwrap_or_default();
        let at = f
            .site
            .as_ref()
            .map(|s| format!(" by {s}"))
            .unwrap_or_default();
        let place = f.place.text();
        let headline = if place.is_empty() {
            format!("OUT OF MEMORY{asked}{at}")
        } else {
            format!("OUT OF MEMORY {place}{asked}{at}")
        };
        Verdict {
            failed: true,
            headline,
            detail: format!("cause: {}; first fix: {fix}", cause_words(cause, f)),
            place: f.place.clone(),
            requested_bytes: f.figures.requested,
            site: f.site.clone(),
            cause: Some(cause),
            fix: Some(fix),
            peak_bytes: None,
            finding: None,
            role: f.largest_role.map(|(r, _)| r),
        }
    }

    /// The verdict on a process the kernel's OOM killer ended (SIGKILL, no
    /// Python left to say so): host memory ran out; `in_use` is the last
    /// figure its records hold, `limit` the memory cgroup's limit where one was set.
    pub fn killed(place: Place, in_use: Option<u64>, limit: Option<u64>) -> Verdict {
        let on = place.text();
        let headline = if on.is_empty() {
            "KILLED FOR MEMORY: the kernel's OOM killer ended the process (SIGKILL)".to_string()
        } else {
            format!("KILLED FOR MEMORY {on}: the kernel's OOM killer ended the process (SIGKILL)")
        };
        let limit_words = limit
            .map(|l| format!(" (the memory cgroup's limit is {})", human_bytes(l)))
            .unwrap_or_default();
        let last = in_use
            .map(|b| format!("; the last records show {} in use", human_bytes(b)))
            .unwrap_or_default();
        let fix = "lower the micro-batch, and keep host copies small: fewer DataLoader workers and a lower prefetch_factor, data loaded lazily or memory-mapped, checkpoints loaded with mmap=True".to_string();
        Verdict {
            failed: true,
            headline,
            detail: format!("cause: host memory ran out{limit_words}{last}; first fix: {fix}"),
            place,
            requested_bytes: None,
            site: None,
            cause: Some(Cause::Capacity),
            fix: Some(fix),
            peak_bytes: in_use,
            finding: None,
            role: None,
        }
    }

    /// The verdict on a run whose records do not say it failed but do not
    /// say it finished either, or in which nothing was measured: `headline`
    /// says what the log shows, `detail` why and what would tell more.
    pub fn inconclusive(
        place: Place,
        headline: String,
        detail: String,
        peak: Option<u64>,
    ) -> Verdict {
        let on = place.text();
        Verdict {
            failed: false,
            headline: if on.is_empty() {
                headline
            } else {
                format!("{headline} {on}")
            },
            detail,
            place,
            requested_bytes: None,
            site: None,
            cause: None,
            fix: None,
            peak_bytes: peak,
            finding: None,
            role: None,
        }
    }

    /// The verdict on a run that did not fail: its peak, where, and its most urgent finding.
    pub fn healthy(peak: u64, place: Place, findings: &[Finding]) -> Verdict {
        let on = place.text();
        let on = if on.is_empty() {
            String::new()
        } else {
            format!(" {on}")
        };
        let top = findings.first();
        Verdict {
            failed: false,
            headline: format!("no OOM; peak {}{on}", human_bytes(peak)),
            detail: match top {
                Some(f) => format!("most important: [{}] {}", f.kind.as_str(), f.message),
                None => "no finding: nothing here calls for a change".into(),
            },
            place,
            requested_bytes: None,
            site: None,
            cause: None,
            fix: None,
            peak_bytes: Some(peak),
            finding: top.map(|f| f.kind),
            role: None,
        }
    }
}

/// The cause in words, with the figures that decided it.
fn cause_words(cause: Cause, f: &Failure) -> String {
    let g = &f.figures;
    let b = |v: Option<u64>| v.map(human_bytes).unwrap_or_else(|| "?".into());
    match cause {
        Cause::Capacity => {
            let mut figures = Vec::new();
            if let Some(live) = f.live {
                figures.push(format!("{} held by tensors", human_bytes(live)));
                if let Some((role, bytes)) = f.largest_role.filter(|_| live > 0) {
                    figures.push(format!(
                        "{:.0}% of it {}",
                        100.0 * bytes as f64 / live as f64,
                        role.words()
                    ));
                }
            }
            if let Some(free) = g.free {
                figures.push(format!("{} free on the device", human_bytes(free)));
            }
            if let Some(c) = g.capacity {
                figures.push(format!("of {}", human_bytes(c)));
            }
            if figures.is_empty() {
                "capacity: the device was full".into()
            } else {
                format!("capacity ({})", figures.join(", ").replace(", of ", " of "))
            }
        }
        Cause::Fragmentation => format!(
            "fragmentation ({} reserved but unallocated, in pieces too small for the request)",
            b(g.reserved_unallocated)
        ),
        Cause::RequestExceedsCapacity => format!(
            "the request alone is larger than the device ({})",
            b(g.capacity)
        ),
        Cause::OtherProcesses => format!(
            "other processes held {} of the device",
            human_bytes(g.other_processes)
        ),
        Cause::MemoryFractionLimit => match g.allowed {
            Some(allowed) => format!(
                "the process reached its own memory cap ({}) while the device had {} free",
                human_bytes(allowed),
                b(g.free)
            ),
            None => format!(
                "the device had {} free, more than the {} asked for: the process reached a memory cap of its own (set_per_process_memory_fraction, which the file does not record), or the driver would not give one piece that large",
                b(g.free),
                b(g.requested)
            ),
        },
    }
}

/// The smallest change that can fix a failure of this cause, with its number.
pub fn first_fix(cause: Cause, f: &Failure) -> String {
    let g = &f.figures;
    match cause {
        Cause::Capacity => match g.shortfall() {
            Some(s) if s > 0 => format!(
                "free at least {} more: lower the micro-batch and raise gradient accumulation to keep the \
                 effective batch (`oomkit run` does both), or enable activation checkpointing",
                human_bytes(s)
            ),
            _ => "lower the micro-batch and raise gradient accumulation to keep the effective batch \
                  (`oomkit run` does both), or enable activation checkpointing"
                .into(),
        },
        Cause::Fragmentation if f.expandable_segments => format!(
            "expandable segments are already on: call torch.cuda.empty_cache() before the failing phase \
             ({} sits reserved but unused)",
            g.reserved_unallocated
                .map(human_bytes)
                .unwrap_or_else(|| "memory".into())
        ),
        Cause::Fragmentation => format!(
            "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the {} reserved but unallocated could then hold the request",
            g.reserved_unallocated
                .map(human_bytes)
                .unwrap_or_else(|| "memory".into())
        ),
        Cause::RequestExceedsCapacity => format!(
            "no micro-batch or allocator setting fixes a single request of {} on a {} device: check the size \
             computed {} (an overflow or a wrong shape), or split that tensor (chunk the operation, or shard it \
             across GPUs)",
            g.requested.map(human_bytes).unwrap_or_else(|| "this size".into()),
            g.capacity.map(human_bytes).unwrap_or_else(|| "smaller".into()),
            f.site
                .as_ref()
                .map(|s| format!("at {s}"))
                .unwrap_or_else(|| "where it was asked".into())
        ),
        Cause::OtherProcesses => format!(
            "run on a GPU that other processes leave free (`oomkit run` picks one and waits for it), or stop \
             the processes holding {}",
            human_bytes(g.other_processes)
        ),
        Cause::MemoryFractionLimit if g.allowed.is_none() => format!(
            "if the process sets torch.cuda.set_per_process_memory_fraction, raise it: the device had {} free; \
             if it does not, lower the micro-batch and raise gradient accumulation to keep the effective batch",
            g.free.map(human_bytes).unwrap_or_else(|| "room".into())
        ),
        Cause::MemoryFractionLimit => format!(
            "raise torch.cuda.set_per_process_memory_fraction: the device had {} free",
            g.free.map(human_bytes).unwrap_or_else(|| "room".into())
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn failure(requested: u64) -> Failure {
        Failure {
            place: Place {
                device: Some("cuda:1".into()),
                event: Some(4120),
                ..Place::default()
            },
            figures: Figures {
                requested: Some(requested),
                capacity: Some(80 * GIB),
                free: Some(GIB),
                reserved_unallocated: Some(GIB / 2),
                ..Figures::default()
            },
            live: Some(78 * GIB),
            site: Some("models.py:181 update_nodes".into()),
            expandable_segments: false,
            largest_role: None,
        }
    }

    #[test]
    fn a_failure_names_the_share_of_its_largest_role() {
        let f = Failure {
            largest_role: Some((Role::Activations, 39 * GIB)),
            ..failure(2 * GIB)
        };
        let v = Verdict::failed(&f, Cause::Capacity);
        assert!(
            v.detail
                .contains("78.0 GiB held by tensors, 50% of it activations"),
            "{}",
            v.detail
        );
        assert_eq!(v.role, Some(Role::Activations));
    }

    #[test]
    fn a_capacity_failure_names_the_device_the_site_and_the_shortfall() {
        let v = Verdict::failed(&failure(3 * GIB), Cause::Capacity);
        assert_eq!(
            v.headline,
            "OUT OF MEMORY on cuda:1 at event 4120; 3.00 GiB requested by models.py:181 update_nodes"
        );
        assert!(
            v.detail.contains("free at least 2.00 GiB more"),
            "{}",
            v.detail
        );
    }

    #[test]
    fn a_request_larger_than_the_device_is_not_answered_with_a_smaller_batch() {
        let v = Verdict::failed(&failure(1 << 62), Cause::RequestExceedsCapacity);
        let fix = v.fix.unwrap();
        assert!(
            fix.starts_with("no micro-batch or allocator setting fixes"),
            "{fix}"
        );
        assert!(fix.contains("at models.py:181 update_nodes"), "{fix}");
        assert!(!fix.contains("lower the micro-batch"), "{fix}");
    }

    #[test]
    fn a_healthy_run_leads_with_its_peak_and_top_finding() {
        let f = Finding::new(FindingKind::Leak, "memory grows".into(), "stop it");
        let v = Verdict::healthy(5 * GIB, Place::default(), &[f]);
        assert_eq!(v.headline, "no OOM; peak 5.00 GiB");
        assert_eq!(v.detail, "most important: [leak] memory grows");
        assert!(!v.failed);
    }
}
