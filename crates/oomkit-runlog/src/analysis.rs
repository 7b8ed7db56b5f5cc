//! What a run log says: stage table, leaks, eval spikes, gradients, components; the types it fills are in `report.rs`.

use crate::findings;
use crate::record::{MeasureKind, Run, LOG_VERSION};
use crate::report::{Analysis, Ending, Leak, OomSummary, StageGrowth, StageStats, Warning};
use oomkit_advice::Cause;
use std::collections::BTreeMap;

const MIB: u64 = 1 << 20;

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0u64), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// Fits y = a + b·x by least squares; returns (slope, R²).
fn fit(points: &[(f64, f64)]) -> (f64, f64) {
    let mx = mean(points.iter().map(|p| p.0));
    let my = mean(points.iter().map(|p| p.1));
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let syy: f64 = points.iter().map(|p| (p.1 - my).powi(2)).sum();
    if sxx == 0.0 {
        return (0.0, 0.0);
    }
    let slope = sxy / sxx;
    let r2 = if syy == 0.0 {
        0.0
    } else {
        (sxy * sxy) / (sxx * syy)
    };
    (slope, r2)
}

/// Least steps after warm-up for a leak verdict.
const LEAK_MIN_STEPS: usize = 6;
/// Least R² for a leak verdict: the growth must be steady, not noise.
const LEAK_MIN_R2: f64 = 0.8;
/// Least growth over the window for a leak verdict, in bytes...
const LEAK_MIN_GROWTH_BYTES: u64 = MIB;
/// ... and as a share of the run's level: less is the allocator's rounding.
const LEAK_MIN_GROWTH_SHARE: f64 = 0.01;
/// Least growth where the figures are the process's resident set (CPU): glibc
/// grows and trims its heap by a few MiB on its own, and a loaded machine's
/// resident set drifts by about as much over a short run.
const LEAK_MIN_GROWTH_BYTES_RSS: u64 = 4 * MIB;
/// Parts of the window that must each end higher than the one before: a leak
/// keeps growing, where a heap that rose in a few jumps and then stayed has
/// settled (a clean loop's resident set, measured on a loaded machine, rose
/// 8 MiB in three jumps between steps 18 and 27 of 40, steady enough to fit a line).
const LEAK_GROWING_PARTS: usize = 3;

fn leak(run: &Run, capacity: Option<u64>, cuda: bool) -> Option<Leak> {
    let steps: Vec<(u64, u64)> = run
        .steps()
        .enumerate()
        .map(|(i, m)| (m.step.unwrap_or(i as u64), m.end_bytes))
        .collect();
    // The first steps allocate gradients and optimizer state for good.
    let warmup = (steps.len() / 10).max(2);
    let window = steps.get(warmup..)?;
    if window.len() < LEAK_MIN_STEPS {
        return None;
    }
    let pts: Vec<(f64, f64)> = window.iter().map(|&(s, b)| (s as f64, b as f64)).collect();
    let (slope, r2) = fit(&pts);
    let (first, last) = (window[0], window[window.len() - 1]);
    let growth = last.1.saturating_sub(first.1);
    // Growth must be a share of what the run holds, above what is not the
    // run's (findings::run_floor): a tiny CPU model's leak of 250 KiB a step
    // is 0.9% of the RSS but a fifth of what the run added.
    let level = window
        .iter()
        .map(|w| w.1)
        .max()
        .unwrap_or(0)
        .saturating_sub(findings::run_floor(run, cuda));
    if slope <= 0.0
        || r2 < LEAK_MIN_R2
        || growth
            < if cuda {
                LEAK_MIN_GROWTH_BYTES
            } else {
                LEAK_MIN_GROWTH_BYTES_RSS
            }
        || (growth as f64) < LEAK_MIN_GROWTH_SHARE * level as f64
        || !grows_in_every_part(window)
    {
        return None;
    }
    let full_at_step = capacity.map(|c| {
        let left = c.saturating_sub(last.1) as f64;
        last.0 + (left / slope).ceil() as u64
    });
    Some(Leak {
        bytes_per_step: slope,
        confidence: r2,
        first_step: first.0,
        last_step: last.0,
        start_bytes: first.1,
        end_bytes: last.1,
        full_at_step,
    })
}

/// Whether each of [`LEAK_GROWING_PARTS`] consecutive parts of the window ends above where the one before ended.
fn grows_in_every_part(window: &[(u64, u64)]) -> bool {
    let last = window.len() - 1;
    let ends: Vec<u64> = (0..=LEAK_GROWING_PARTS)
        .map(|k| window[k * last / LEAK_GROWING_PARTS].1)
        .collect();
    ends.windows(2).all(|w| w[1] > w[0])
}

fn stage_table(run: &Run) -> Vec<StageStats> {
    let mut groups: BTreeMap<(MeasureKind, String), Vec<&crate::record::Measure>> = BTreeMap::new();
    for (k, m) in &run.measures {
        groups.entry((*k, m.name.clone())).or_default().push(m);
    }
    let order = |name: &str| match name {
        "forward" => 0,
        "backward" => 1,
        "optimizer" => 2,
        _ => 3,
    };
    let mut v: Vec<StageStats> = groups
        .into_iter()
        .map(|((kind, name), ms)| StageStats {
            kind,
            count: ms.len() as u64,
            mean_peak_bytes: mean(ms.iter().map(|m| m.peak_bytes as f64)) as u64,
            max_peak_bytes: ms.iter().map(|m| m.peak_bytes).max().unwrap_or(0),
            mean_delta_bytes: mean(ms.iter().map(|m| m.end_bytes as f64 - m.start_bytes as f64))
                as i64,
            mean_rise_bytes: mean(
                ms.iter()
                    .map(|m| m.peak_bytes.saturating_sub(m.start_bytes) as f64),
            ) as u64,
            mean_seconds: mean(ms.iter().map(|m| m.seconds)),
            peaks_bounded: ms.iter().filter(|m| m.peak_is_bound()).count() as u64,
            max_peak_at_most_bytes: {
                let max = ms.iter().map(|m| m.peak_bytes).max().unwrap_or(0);
                ms.iter()
                    .filter(|m| m.peak_is_bound())
                    .filter_map(|m| m.peak_at_most_bytes)
                    .max()
                    .filter(|&most| most > max)
            },
            name,
        })
        .collect();
    v.sort_by_key(|s| (s.kind, order(&s.name), s.name.clone()));
    v
}

fn cause(requested: Option<u64>, m: &crate::record::OomMemory) -> Cause {
    oomkit_advice::decide(&oomkit_advice::Figures {
        requested,
        capacity: m.capacity_bytes,
        reserved_unallocated: Some(m.reserved_bytes.saturating_sub(m.allocated_bytes)),
        // The cap, where the message or the allocator said one was set, and
        // what the driver had free then: room under a known cap blames the cap.
        allowed: m.allowed_bytes,
        free: m.free_bytes,
        ..Default::default()
    })
}

/// How the log says the run ended.
fn ending(run: &Run) -> Ending {
    let Some(end) = run.end.as_ref().filter(|_| run.closed) else {
        return Ending::Unfinished;
    };
    match end.ended.as_deref() {
        Some("killed") if end.killed_for_memory() => Ending::KilledForMemory,
        Some("killed") => Ending::Killed,
        Some("exception") => Ending::Exception,
        Some("exit") => Ending::Exit,
        _ => Ending::Closed,
    }
}

/// The run's peak: its largest step peak; in a log with no step, the most
/// any stage, phase or OOM record measured, or else the tracker's last
/// reading of the process's high-water mark; `None` where nothing was measured.
fn measured_peak(run: &Run) -> Option<u64> {
    if let Some(p) = run.steps().map(|m| m.peak_bytes).max() {
        return Some(p);
    }
    let measures = run
        .measures
        .iter()
        .map(|(_, m)| m.peak_bytes.max(m.end_bytes));
    let ooms = run
        .ooms
        .iter()
        .map(|o| o.memory.peak_bytes.max(o.memory.allocated_bytes));
    let peak = measures.chain(ooms).filter(|&b| b > 0).max();
    // Only where no record measured anything, the process's high-water mark
    // (which also counts what ran before the tracker) stands in.
    peak.or_else(|| run.end.as_ref()?.peak_bytes.filter(|&b| b > 0))
}

/// Why a log has no steps, from what it did see, with the one change that gives it steps.
fn no_steps(run: &Run, ooms: &[OomSummary]) -> Option<String> {
    if run.steps().next().is_some() {
        return None;
    }
    if let Some(o) = ooms.first().filter(|o| o.killed_by_kernel) {
        return Some(format!(
            "no step finished: the kernel's OOM killer ended the process in {}",
            o.step
                .map_or("its first step".to_string(), |s| format!("step {s}"))
        ));
    }
    if let Some(o) = ooms.first() {
        return Some(format!(
            "no step finished: it ran out of memory in {}{}",
            o.step
                .map_or("its first step".to_string(), |s| format!("step {s}")),
            o.stage
                .as_ref()
                .map(|st| format!(" ({st})"))
                .unwrap_or_default()
        ));
    }
    let phases: Vec<&str> = {
        let mut v: Vec<&str> = run
            .measures
            .iter()
            .filter(|(k, _)| *k == MeasureKind::Phase)
            .map(|(_, m)| m.name.as_str())
            .collect();
        v.dedup();
        v
    };
    if !phases.is_empty() {
        let evaluation = phases.iter().all(|p| {
            matches!(
                *p,
                "test" | "predict" | "eval" | "validate" | "sanity_check"
            )
        });
        let names = phases
            .iter()
            .map(|p| format!("[{p}]"))
            .collect::<Vec<_>>()
            .join(", ");
        return Some(if evaluation {
            format!("a {names}-only log: no training ran while it was open (Lightning's trainer.test() and trainer.predict() each write a log of their own)")
        } else {
            format!("only phases were measured ({names}), no training step: mark steps with `with tracker.step(i):`")
        });
    }
    let fix = "wrap each training step in `with tracker.step(i):`, or give the tracker the optimizer (`oomkit.Tracker(model, optimizer=opt)`), whose steps then count as steps";
    Some(match run.end.as_ref().and_then(|e| e.seen.as_ref()) {
        Some(seen) if seen.forward + seen.backward + seen.optimizer > 0 => format!(
            "the tracker saw {} forward, {} backward and {} optimizer {} but no training step: {fix}",
            seen.forward,
            seen.backward,
            seen.optimizer,
            if seen.optimizer == 1 { "step" } else { "steps" }
        ),
        Some(_) => format!(
            "the tracker saw no forward pass of the model it was given (was it built on another model, or closed before training?): {fix}"
        ),
        None => format!("the log records no step, stage or phase: {fix}"),
    })
}

/// The verdict on a run log: its first OOM, a kill, an end it does not
/// record, or its peak and most urgent finding.
fn verdict(
    run: &Run,
    ooms: &[OomSummary],
    start: &crate::record::Start,
    capacity: Option<u64>,
    peak: Option<u64>,
    findings: &[oomkit_advice::Finding],
) -> oomkit_advice::Verdict {
    use oomkit_advice::{Place, Verdict};
    let rank = Some(start.rank);
    if let Some(o) = ooms.first().filter(|o| !o.killed_by_kernel) {
        return Verdict::failed(&o.failure(&start.device, rank, capacity), o.cause);
    }
    let device = (!start.device.is_empty()).then(|| start.device.clone());
    let last = run.measures.last().map(|(_, m)| m);
    let last_step = run.steps().last().and_then(|m| m.step);
    let place = Place {
        device: device.clone(),
        rank,
        ..Default::default()
    };
    let hb = oomkit_units::human_bytes;
    let peak_words = |p: Option<u64>| {
        p.map(|b| format!("peak {}", hb(b)))
            .unwrap_or_else(|| "no memory figure".into())
    };
    let end = run.end.as_ref();
    match ending(run) {
        Ending::KilledForMemory => {
            let limit = end
                .and_then(|e| e.limit_bytes)
                .or(capacity.filter(|_| start.capacity_source.as_deref() == Some("cgroup")));
            Verdict::killed(
                Place {
                    step: ooms.last().and_then(|o| o.step),
                    ..place
                },
                last.map(|m| m.end_bytes.max(m.peak_bytes)).or(peak),
                limit,
            )
        }
        Ending::Killed => Verdict::inconclusive(
            place,
            format!(
                "no OOM recorded; signal {} ended the process{}",
                end.and_then(|e| e.signal).unwrap_or(0),
                last_step
                    .map(|s| format!(" after step {s}"))
                    .unwrap_or_default()
            ),
            format!(
                "the kernel recorded no OOM kill while it ran, so something else ended it; its last records show {}",
                peak_words(peak)
            ),
            peak,
        ),
        Ending::Unfinished => Verdict::inconclusive(
            place,
            format!(
                "no OOM recorded, but the log stops without an 'end' record{}",
                last_step
                    .map(|s| format!(" after step {s}"))
                    .unwrap_or_default()
            ),
            format!(
                "the process was killed (exit code 137 is SIGKILL: the kernel's OOM killer, which `dmesg` names, kills that way; under `oomkit run` the log says which), crashed, or is still running; its last records are the evidence: {}{}",
                peak_words(peak),
                capacity
                    .map(|c| format!(" of {}", hb(c)))
                    .unwrap_or_default()
            ),
            peak,
        ),
        Ending::Exception => Verdict::inconclusive(
            place,
            "no OOM; an uncaught exception ended the run".into(),
            format!(
                "{}; {}",
                end.and_then(|e| e.exception.clone())
                    .unwrap_or_else(|| "the exception is not recorded".into()),
                peak_words(peak)
            ),
            peak,
        ),
        Ending::Closed | Ending::Exit => match peak {
            Some(p) => Verdict::healthy(p, place, findings),
            None => Verdict::inconclusive(
                place,
                "nothing measured".into(),
                no_steps(run, ooms).unwrap_or_else(|| "the log records no memory figure".into()),
                None,
            ),
        },
    }
}

/// The stage that needs the most on top of what was there when it began; none without a peak to share.
fn largest_growth(stages: &[StageStats], train_peak: u64) -> Option<StageGrowth> {
    stages
        .iter()
        .filter(|s| s.kind != MeasureKind::Step)
        .max_by_key(|s| s.mean_rise_bytes)
        .map(|s| StageGrowth {
            kind: s.kind,
            name: s.name.clone(),
            mean_rise_bytes: s.mean_rise_bytes,
            share_of_peak: if train_peak > 0 {
                s.mean_rise_bytes as f64 / train_peak as f64
            } else {
                0.0
            },
            at_least: s.peaks_bounded > 0,
        })
        // Without a peak to share, there is no growth to tell.
        .filter(|g| g.mean_rise_bytes > 0 && train_peak > 0)
}

/// The log's OOMs, each with its cause; a kill by the kernel's OOM killer is one too, so that every table that counts OOMs counts it.
fn oom_summaries(run: &Run) -> Vec<OomSummary> {
    let mut ooms: Vec<OomSummary> = run
        .ooms
        .iter()
        .map(|o| OomSummary {
            time: o.time,
            step: o.step,
            stage: o.stage.clone().or_else(|| o.phase.clone()),
            requested_bytes: o.requested_bytes,
            allocated_bytes: o.memory.allocated_bytes,
            reserved_bytes: o.memory.reserved_bytes,
            cause: cause(o.requested_bytes, &o.memory),
            snapshot: o.snapshot.clone(),
            killed_by_kernel: false,
        })
        .collect();
    if ending(run) == Ending::KilledForMemory {
        let last = run.measures.last().map(|(_, m)| m);
        ooms.push(OomSummary {
            time: run.end.as_ref().and_then(|e| e.time),
            // The step in progress: the last stage's, or the one after the last step that finished.
            step: match run.measures.last() {
                Some((MeasureKind::Step, m)) => m.step.map(|s| s + 1),
                Some((_, m)) => m.step,
                None => None,
            },
            stage: None,
            requested_bytes: None,
            allocated_bytes: last.map_or(0, |m| m.end_bytes),
            reserved_bytes: last.map_or(0, |m| m.reserved_bytes),
            cause: Cause::Capacity,
            snapshot: None,
            killed_by_kernel: true,
        });
    }
    ooms
}

/// The limits of the evidence in a log.
fn warnings(run: &Run, start: &crate::record::Start, cuda: bool) -> Vec<Warning> {
    let mut warnings = Vec::new();
    if run.start.is_none() {
        warnings.push(Warning {
            kind: "no_start",
            message: "the log has no 'start' record: device, capacity and components are unknown"
                .into(),
        });
    }
    if let Some(v) = run
        .start
        .as_ref()
        .map(|s| s.version)
        .filter(|&v| v > LOG_VERSION)
    {
        warnings.push(Warning {
            kind: "newer_version",
            message: format!(
                "the log is format version {v}, written by a newer oomkit; this one reads version {LOG_VERSION}: records and fields added since are ignored (update oomkit to read them)"
            ),
        });
    }
    if run.torn_last_line {
        warnings.push(Warning {
            kind: "torn_last_line",
            message: "the last line was cut short: the process was killed while writing it".into(),
        });
    } else if !run.closed && run.ooms.is_empty() {
        warnings.push(Warning {
            kind: "not_closed",
            message: "the log has no 'end' record: the run is still going, crashed, or \
                      tracker.close() was not called"
                .into(),
        });
    }
    if !run.tracker_errors.is_empty() {
        warnings.push(Warning {
            kind: "tracker_errors",
            message: format!(
                "the tracker caught {} of its own, first: {}",
                oomkit_units::count(run.tracker_errors.len() as u64, "error", "errors"),
                run.tracker_errors[0]
            ),
        });
    }
    if !cuda && !start.device.is_empty() {
        warnings.push(Warning {
            kind: "cpu_memory",
            message: if start.capacity_source.as_deref() == Some("cgroup") {
                "on CPU, memory is the process's resident set (RSS), which also holds \
                 Python, libraries and the allocator's caches; shared library pages count in \
                 it but not always against the memory cgroup's limit, so it can read above that limit"
                    .into()
            } else {
                "on CPU, memory is the process's resident set (RSS), which also holds \
                 Python, libraries and the allocator's caches"
                    .into()
            },
        });
    }
    warnings
}

/// Analyzes a run log.
pub fn analyze(run: &Run) -> Analysis {
    let start = run.start.clone().unwrap_or_default();
    let cuda = start.device.starts_with("cuda");
    let capacity = start.capacity_bytes.filter(|&c| c > 0);
    let stages = stage_table(run);
    let peak = measured_peak(run);
    let train_peak = run
        .measures
        .iter()
        .filter(|(k, _)| *k != MeasureKind::Phase)
        .map(|(_, m)| m.peak_bytes)
        .max()
        .unwrap_or(0);
    let largest_growth = largest_growth(&stages, train_peak);
    let components = run
        .components
        .last()
        .cloned()
        .or_else(|| run.start.as_ref().map(|s| s.components.clone()));
    let leak = leak(run, capacity, cuda);
    let ooms = oom_summaries(run);
    let nonfinite_checks = run
        .grads
        .iter()
        .filter(|g| g.nan_params + g.inf_params > 0)
        .count() as u64;
    let findings = findings::findings(&findings::Facts {
        run,
        device: &start.device,
        cuda,
        train_peak,
        capacity,
        ooms: &ooms,
        leak: leak.as_ref(),
        components: components.as_ref(),
    });

    let warnings = warnings(run, &start, cuda);
    let no_steps = no_steps(run, &ooms);
    Analysis {
        verdict: verdict(run, &ooms, &start, capacity, peak, &findings),
        kind: "run",
        steps: run.steps().count() as u64,
        rank: start.rank,
        device: start.device.clone(),
        capacity_bytes: capacity,
        peak_bytes: peak,
        peak_reserved_bytes: run
            .measures
            .iter()
            .map(|(_, m)| m.reserved_bytes)
            .max()
            .unwrap_or(0),
        stages,
        largest_growth,
        leak,
        components,
        grad_nonfinite_checks: nonfinite_checks,
        ooms,
        plan: run.plans.last().cloned(),
        plans: run.plans.clone(),
        closed: run.closed,
        ending: ending(run),
        attempt: start
            .attempt
            .or_else(|| run.plans.last().and_then(|p| p.attempt)),
        seen: run.end.as_ref().and_then(|e| e.seen.clone()),
        steps_from_optimizer: run.steps().next().is_some() && run.steps().all(|m| m.auto),
        no_steps,
        start_attempt: start.attempt,
        findings,
        warnings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oomkit_advice::FindingKind;

    fn log(ends: &[u64]) -> String {
        let mut s = String::from(
            r#"{"type":"start","version":1,"device":"cuda:0","capacity_bytes":1073741824}"#,
        );
        s.push('\n');
        for (i, e) in ends.iter().enumerate() {
            s.push_str(&format!(
                "{{\"type\":\"step\",\"step\":{i},\"start_bytes\":{e},\"end_bytes\":{e},\"peak_bytes\":{}}}\n",
                e + 1000
            ));
        }
        s.push_str("{\"type\":\"end\"}\n");
        s
    }

    /// A CPU run whose eval keeps 1 GiB of outputs: RSS stays up after it, so
    /// the steps after the eval peak above the eval itself.
    fn eval_keeps_outputs() -> String {
        let mut s = String::from(r#"{"type":"start","version":1,"device":"cpu"}"#);
        s.push('\n');
        let step = |s: &mut String, i: u64, level: u64| {
            s.push_str(&format!(
                "{{\"type\":\"step\",\"step\":{i},\"start_bytes\":{level},\"end_bytes\":{level},\"peak_bytes\":{}}}\n",
                level + 100 * MIB
            ));
        };
        for i in 0..5 {
            step(&mut s, i, 700 * MIB);
        }
        s.push_str(&format!(
            "{{\"type\":\"phase\",\"step\":4,\"name\":\"eval\",\"start_bytes\":{},\"end_bytes\":{},\"peak_bytes\":{}}}\n",
            700 * MIB,
            1700 * MIB,
            1780 * MIB
        ));
        for i in 5..10 {
            step(&mut s, i, 1700 * MIB);
        }
        s.push_str("{\"type\":\"end\"}\n");
        s
    }

    #[test]
    fn an_eval_spike_is_measured_against_the_steps_before_it() {
        let a = analyze(&Run::parse(eval_keeps_outputs().as_bytes()).unwrap());
        let spike = a
            .findings
            .iter()
            .find(|f| f.kind == FindingKind::EvalSpike)
            .expect("eval_spike");
        // 1780 MiB against the 800 MiB peak of the steps before it, though later steps reach 1800.
        assert_eq!(spike.bytes, Some(980 * MIB));
        assert_eq!(spike.step, Some(4));
    }

    #[test]
    fn an_eval_below_the_training_before_it_is_no_spike() {
        let quiet =
            eval_keeps_outputs().replace(&(1780 * MIB).to_string(), &(810 * MIB).to_string());
        let a = analyze(&Run::parse(quiet.as_bytes()).unwrap());
        assert!(
            a.findings.iter().all(|f| f.kind != FindingKind::EvalSpike),
            "{:?}",
            a.findings
        );
    }

    #[test]
    fn a_log_from_a_newer_oomkit_is_read_with_a_warning() {
        let ends: Vec<u64> = (0..8).map(|_| 100 * MIB).collect();
        let kinds = |text: String| -> Vec<&'static str> {
            analyze(&Run::parse(text.as_bytes()).unwrap())
                .warnings
                .iter()
                .map(|w| w.kind)
                .collect()
        };
        assert!(!kinds(log(&ends)).contains(&"newer_version"));
        let newer = log(&ends).replace(r#""version":1"#, r#""version":2"#);
        assert!(kinds(newer).contains(&"newer_version"));
    }

    #[test]
    fn steady_growth_is_a_leak_with_its_rate() {
        let ends: Vec<u64> = (0..30).map(|i| 100 * MIB + i * 4 * MIB).collect();
        let a = analyze(&Run::parse(log(&ends).as_bytes()).unwrap());
        let l = a.leak.expect("leak");
        assert!((l.bytes_per_step - (4 * MIB) as f64).abs() < 1.0);
        assert!(l.confidence > 0.99);
        // (1 GiB - 216 MiB) / 4 MiB = 202 more steps after step 29.
        assert_eq!(l.full_at_step, Some(29 + 202));
        assert_eq!(a.findings[0].kind, FindingKind::Leak);
    }

    #[test]
    fn a_small_leak_on_cpu_is_measured_against_what_the_run_added() {
        // 700 MiB of Python and libraries, then 256 KiB a step kept in 1 MiB
        // chunks, as glibc grows the heap: under 1% of the RSS.
        let ends: Vec<u64> = (0..30)
            .map(|i| 700 * MIB + (i * 256 * 1024) / MIB * MIB)
            .collect();
        let text = log(&ends).replace(
            r#""device":"cuda:0","capacity_bytes":1073741824"#,
            r#""device":"cpu""#,
        );
        let a = analyze(&Run::parse(text.as_bytes()).unwrap());
        assert!(a.leak.is_some(), "{:?}", a.findings);
        // The same growth on CUDA is under 1% of what the allocator holds: noise there.
        assert!(analyze(&Run::parse(log(&ends).as_bytes()).unwrap())
            .leak
            .is_none());
    }

    #[test]
    fn a_resident_set_drifting_by_a_mib_is_not_a_leak_on_cpu() {
        // As a loaded CI machine measured a healthy tiny run: 73 KiB a step,
        // steady, 1.25 MiB over the window, on 700 MiB of Python and libraries.
        let ends: Vec<u64> = (0..20).map(|i| 700 * MIB + i * 73 * 1024).collect();
        let cpu = log(&ends).replace(
            r#""device":"cuda:0","capacity_bytes":1073741824"#,
            r#""device":"cpu""#,
        );
        assert!(analyze(&Run::parse(cpu.as_bytes()).unwrap()).leak.is_none());
        // The same growth of the CUDA allocator's own count, on 100 MiB, is one.
        let ends: Vec<u64> = (0..20).map(|i| 100 * MIB + i * 73 * 1024).collect();
        assert!(analyze(&Run::parse(log(&ends).as_bytes()).unwrap())
            .leak
            .is_some());
    }

    #[test]
    fn a_resident_set_that_rose_in_jumps_and_stayed_is_not_a_leak() {
        // A clean 40-step loop on a loaded machine, as its log read (KiB):
        // flat, three jumps of 1, 3 and 4 MiB between steps 18 and 27, flat again.
        let kib: Vec<u64> = (0..40)
            .map(|i| match i {
                0..=17 => 1_220_556,
                18..=22 => 1_221_580,
                23..=26 => 1_224_652,
                _ => 1_228_748,
            })
            .collect();
        let ends: Vec<u64> = kib.iter().map(|k| k * 1024).collect();
        let cpu = log(&ends).replace(
            r#""device":"cuda:0","capacity_bytes":1073741824"#,
            r#""device":"cpu""#,
        );
        let a = analyze(&Run::parse(cpu.as_bytes()).unwrap());
        assert!(a.leak.is_none(), "{:?}", a.leak);
        // The same 8 MiB kept a step at a time, to the last step, is one.
        let ends: Vec<u64> = (0..40)
            .map(|i| 1_220_556 * 1024 + i * 8 * MIB / 40)
            .collect();
        let cpu = log(&ends).replace(
            r#""device":"cuda:0","capacity_bytes":1073741824"#,
            r#""device":"cpu""#,
        );
        assert!(analyze(&Run::parse(cpu.as_bytes()).unwrap()).leak.is_some());
    }

    #[test]
    fn flat_or_noisy_memory_is_not_a_leak() {
        let flat: Vec<u64> = (0..30).map(|i| 100 * MIB + (i % 3) * 100_000).collect();
        let a = analyze(&Run::parse(log(&flat).as_bytes()).unwrap());
        assert!(a.leak.is_none(), "{:?}", a.leak);
        assert!(a.findings.iter().all(|f| f.kind != FindingKind::Leak));
    }

    #[test]
    fn warm_up_growth_alone_is_not_a_leak() {
        let mut ends = vec![10 * MIB, 300 * MIB];
        ends.extend(std::iter::repeat_n(500 * MIB, 20));
        let a = analyze(&Run::parse(log(&ends).as_bytes()).unwrap());
        assert!(a.leak.is_none());
    }

    #[test]
    fn a_log_the_kernel_killed_is_an_oom_of_host_memory_with_its_last_records() {
        // As `oomkit run` closes it: a line torn by the kill, then its end record.
        let text = "{\"type\":\"start\",\"version\":1,\"device\":\"cpu\",\"capacity_bytes\":1288490188,\"capacity_source\":\"cgroup\",\"attempt\":2}\n\
            {\"type\":\"step\",\"step\":0,\"start_bytes\":900,\"end_bytes\":1000,\"peak_bytes\":1100}\n\
            {\"type\":\"stage\",\"step\":1,\"name\":\"forward\",\"start_bytes\":1000,\"end_bytes\":1200,\"peak_bytes\":1200}\n\
            {\"type\":\"st\n\
            {\"type\":\"end\",\"ended\":\"killed\",\"signal\":9,\"oom_kill\":true,\"limit_bytes\":1288490188,\"written_by\":\"oomkit run\"}\n";
        let run = Run::parse(text.as_bytes()).unwrap();
        assert!(run.torn_last_line);
        let a = analyze(&run);
        assert_eq!(a.ending, Ending::KilledForMemory);
        assert!(a.verdict.failed && a.verdict.headline.starts_with("KILLED FOR MEMORY"));
        assert_eq!(a.verdict.place.step, Some(1), "the step in progress");
        let [kill] = &a.ooms[..] else {
            panic!("{:?}", a.ooms)
        };
        assert!(kill.killed_by_kernel && kill.cause == Cause::Capacity);
        assert_eq!(kill.allocated_bytes, 1200);
        assert_eq!(a.attempt, Some(2));
        assert!(a
            .findings
            .iter()
            .any(|f| f.kind == FindingKind::Oom && f.message.contains("killed by the kernel")));
        // The same log without `oomkit run`'s end record stops: no verdict of health.
        let stopped: String = text.lines().take(3).map(|l| format!("{l}\n")).collect();
        let b = analyze(&Run::parse(stopped.as_bytes()).unwrap());
        assert_eq!(b.ending, Ending::Unfinished);
        assert!(
            b.verdict.headline.contains("stops without an 'end' record"),
            "{}",
            b.verdict.headline
        );
        assert!(!b.verdict.detail.contains("nothing here calls for a change"));
    }

    #[test]
    fn a_log_without_steps_says_what_it_saw_and_never_reads_zero() {
        let seen = "{\"type\":\"start\",\"version\":1,\"device\":\"cpu\"}\n\
            {\"type\":\"end\",\"steps\":0,\"ended\":\"closed\",\"seen\":{\"forward\":8,\"backward\":8,\"optimizer\":8}}\n";
        let a = analyze(&Run::parse(seen.as_bytes()).unwrap());
        assert_eq!(a.peak_bytes, None);
        let why = a.no_steps.expect("why");
        assert!(
            why.contains("8 forward, 8 backward and 8 optimizer steps")
                && why.contains("tracker.step(i)"),
            "{why}"
        );
        assert_eq!(a.verdict.headline, "nothing measured on rank 0 (cpu)");
        let test_only = "{\"type\":\"start\",\"version\":1,\"device\":\"cpu\"}\n\
            {\"type\":\"phase\",\"name\":\"test\",\"start_bytes\":700,\"end_bytes\":710,\"peak_bytes\":800}\n\
            {\"type\":\"end\"}\n";
        let a = analyze(&Run::parse(test_only.as_bytes()).unwrap());
        assert_eq!(a.peak_bytes, Some(800));
        assert!(a.no_steps.unwrap().contains("[test]-only"));
        assert_eq!(a.verdict.peak_bytes, Some(800));
    }

    #[test]
    fn a_peak_under_an_earlier_high_water_mark_is_a_bound() {
        let text = "{\"type\":\"start\",\"version\":1,\"device\":\"cuda:0\"}\n\
            {\"type\":\"stage\",\"step\":0,\"name\":\"forward\",\"start_bytes\":100,\"end_bytes\":500,\"peak_bytes\":600}\n\
            {\"type\":\"stage\",\"step\":1,\"name\":\"forward\",\"start_bytes\":100,\"end_bytes\":500,\"peak_bytes\":500,\"peak_at_most_bytes\":600}\n\
            {\"type\":\"stage\",\"step\":1,\"name\":\"optimizer\",\"start_bytes\":100,\"end_bytes\":150,\"peak_bytes\":150,\"peak_at_most_bytes\":600}\n\
            {\"type\":\"end\"}\n";
        let a = analyze(&Run::parse(text.as_bytes()).unwrap());
        let stage = |n: &str| a.stages.iter().find(|s| s.name == n).unwrap();
        // The forward's largest peak is exact: the bounded one cannot pass 600.
        assert_eq!(
            (
                stage("forward").peaks_bounded,
                stage("forward").max_peak_at_most_bytes
            ),
            (1, None)
        );
        assert_eq!(stage("optimizer").max_peak_at_most_bytes, Some(600));
    }

    #[test]
    fn the_handed_down_plan_and_an_integrations_plan_are_one_attempt() {
        let text = "{\"type\":\"start\",\"version\":1,\"device\":\"cpu\",\"attempt\":2}\n\
            {\"type\":\"plan\",\"time\":10,\"micro_batch\":16,\"grad_accum\":2,\"attempt\":2,\"source\":\"oomkit run\",\"applied\":null}\n\
            {\"type\":\"plan\",\"time\":12,\"micro_batch\":20,\"grad_accum\":1,\"source\":\"trainer arguments\",\"applied\":false,\"not_applied\":\"own batch_sampler\"}\n\
            {\"type\":\"end\"}\n";
        let run = Run::parse(text.as_bytes()).unwrap();
        let [plan] = &run.plans[..] else {
            panic!("{:?}", run.plans)
        };
        assert_eq!(
            (plan.attempt, plan.time, plan.micro_batch),
            (Some(2), Some(10.0), Some(20))
        );
        assert_eq!(plan.applied, Some(false));
    }

    #[test]
    fn torn_last_line_is_tolerated_but_a_bad_middle_line_is_not() {
        let mut s = log(&[1, 2, 3]);
        s.push_str("{\"type\":\"st");
        let run = Run::parse(s.as_bytes()).unwrap();
        assert!(run.torn_last_line);
        assert_eq!(run.steps().count(), 3);
        let bad = "{\"type\":\"start\"}\nnot json\n{\"type\":\"end\"}\n";
        let e = Run::parse(bad.as_bytes()).unwrap_err().to_string();
        assert!(e.starts_with("line 2:"), "{e}");
        let e = Run::parse(b"hello\n").unwrap_err().to_string();
        assert!(e.starts_with("not an oomkit run log"), "{e}");
    }

    #[test]
    fn the_oom_finding_and_the_verdict_give_the_same_first_fix() {
        // A request larger than the 1 GiB device: no batch change helps, and both say so with the device's size.
        let mut text = log(&[100, 100]);
        text.push_str("{\"type\":\"oom\",\"step\":1,\"stage\":\"forward\",\"requested_bytes\":4611686018427387904,\"message\":\"CUDA out of memory\",\"memory\":{\"allocated_bytes\":100,\"reserved_bytes\":200,\"capacity_bytes\":1073741824}}\n");
        let a = analyze(&Run::parse(text.as_bytes()).unwrap());
        let fix = a.verdict.fix.clone().expect("a fix");
        assert!(fix.contains("on a 1.00 GiB device"), "{fix}");
        let finding = a
            .findings
            .iter()
            .find(|f| f.kind == FindingKind::Oom)
            .expect("oom finding");
        assert_eq!(finding.advice, fix);
    }

    #[test]
    fn an_oom_under_the_process_s_own_cap_is_told_by_the_message_s_figures() {
        // As an H200 run capped by set_per_process_memory_fraction(0.25) wrote it:
        // 12.3 GiB asked for, 114 GiB free on the device, 34.9 GiB allowed.
        let mut text = log(&[100, 100]);
        text.push_str("{\"type\":\"oom\",\"step\":1,\"stage\":\"forward\",\"requested_bytes\":13174571008,\"message\":\"CUDA out of memory\",\"memory\":{\"allocated_bytes\":26466444800,\"reserved_bytes\":26581401600,\"capacity_bytes\":150109880320,\"allowed_bytes\":37526937600,\"free_bytes\":122822451200}}\n");
        let a = analyze(&Run::parse(text.as_bytes()).unwrap());
        assert_eq!(a.ooms[0].cause, Cause::MemoryFractionLimit);
        // Without the message's figures (older logs), capacity, as before.
        let old = text.replace(
            ",\"allowed_bytes\":37526937600,\"free_bytes\":122822451200",
            "",
        );
        let a = analyze(&Run::parse(old.as_bytes()).unwrap());
        assert_eq!(a.ooms[0].cause, Cause::Capacity);
    }
}
