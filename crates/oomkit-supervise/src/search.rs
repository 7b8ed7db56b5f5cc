//! Finding the largest micro-batch that fits, in as few runs as possible.
//!
//! Peak memory is close to affine in the micro-batch: `M(b) = fixed + b *
//! per_sample`. After one successful run at `b1` with peak `p1`, any batch up
//! to `b1 * budget / p1` fits if the curve is affine (the fixed part only
//! shrinks relative to the batch), so the second run goes there: it is safe
//! and far enough from the first to measure the slope well. The line through
//! the two points predicts the largest batch; one run confirms it. When the
//! prediction fails, bisection between the largest fit and the smallest
//! failure finishes the job.

use serde::Serialize;

/// Predictions aim this far under the line's crossing, so 1% of noise does not turn a confirming run into a miss.
const AIM_UNDER: f64 = 0.99;
/// Unless exact, the search stops once the largest fit is within this fraction of the smallest failure, which bounds its error.
const BRACKET: f64 = 0.04;

/// The result of running the command at one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Trial {
    /// The micro-batch tried.
    pub batch: u64,
    /// Whether it ran without OOM and its peak stayed within the budget.
    pub ok: bool,
    /// Whether it ran out of memory (or failed).
    pub oom: bool,
    /// The measured peak, where one was measured.
    pub peak_bytes: Option<u64>,
}

/// What the search may do.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SearchConfig {
    /// The first micro-batch to try.
    pub start: u64,
    /// The largest micro-batch worth trying.
    pub max: u64,
    /// Memory available to the command.
    pub capacity_bytes: u64,
    /// The fraction of capacity to leave free.
    pub margin: f64,
    /// Search to the exact largest micro-batch (the next one up is tried and
    /// fails), where runs are cheap (`oomkit preflight`, seconds each);
    /// otherwise stop within [`BRACKET`] of it, where each run is a real one.
    pub exact: bool,
}

impl SearchConfig {
    /// Capacity less the margin: the most a recommended batch may use.
    pub fn budget(&self) -> u64 {
        (self.capacity_bytes as f64 * (1.0 - self.margin.clamp(0.0, 0.95))) as u64
    }
}

/// What the search found.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SearchResult {
    /// Every run, in order.
    pub trials: Vec<Trial>,
    /// The largest micro-batch that fitted the budget, if any did.
    pub recommended_batch: Option<u64>,
    /// The fitted fixed memory, where two peaks were measured.
    pub fixed_bytes: Option<f64>,
    /// The fitted memory per sample, where two peaks were measured.
    pub per_sample_bytes: Option<f64>,
    /// "model" when the prediction held, "bisection" when it needed refining.
    pub method: &'static str,
}

/// Runs `probe` at chosen batch sizes and returns the largest batch within the budget.
///
/// Long on purpose: its phases (step down to a first fit, the provably safe
/// second point, the line's prediction and one refit, geometric growth,
/// then false position and bisection) share the bracket between the largest
/// fit and the smallest failure, and read in the order the module's
/// documentation gives them.
pub fn search(cfg: &SearchConfig, probe: &mut dyn FnMut(u64) -> Trial) -> SearchResult {
    let budget = cfg.budget();
    let max = cfg.max.max(1);
    let mut trials: Vec<Trial> = Vec::new();
    let mut run = |b: u64, trials: &mut Vec<Trial>| -> Trial {
        if let Some(t) = trials.iter().find(|t| t.batch == b) {
            return *t;
        }
        let mut t = probe(b);
        t.batch = b;
        if t.peak_bytes.is_some_and(|p| p > budget) {
            t.ok = false;
        }
        trials.push(t);
        t
    };
    let mut method = "model";
    // The largest batch known to fit and the smallest known not to.
    let mut hi: Option<u64> = None;
    let mut b = cfg.start.clamp(1, max);
    let mut lo: Option<u64> = loop {
        let t = run(b, &mut trials);
        if t.ok {
            break Some(b);
        }
        hi = Some(b);
        if b == 1 {
            return finish(trials, None, None, "bisection");
        }
        b /= 2;
        method = "bisection";
    };

    let fits = |t: &Trial| t.ok;
    // A run that ran out of memory stopped where it died: its peak is not
    // what its batch needs, so it never feeds the line.
    let peak_of = |trials: &[Trial], b: u64| {
        trials
            .iter()
            .find(|t| t.batch == b && !t.oom)
            .and_then(|t| t.peak_bytes)
    };
    let line = |b1: u64, p1: u64, b2: u64, p2: u64| {
        let slope = (p2 as f64 - p1 as f64) / (b2 as f64 - b1 as f64);
        (p1 as f64 - slope * b1 as f64, slope)
    };
    let mut fit: Option<(f64, f64)> = None;
    // Second point: as far as is provably safe under the affine model.
    if let (Some(b1), None) = (lo, hi) {
        match peak_of(&trials, b1).filter(|p| *p > 0) {
            Some(p1) => {
                let safe = ((b1 as f64) * budget as f64 / p1 as f64).floor() as u64;
                let b2 = safe.min(max);
                if b2 > b1 {
                    let t2 = run(b2, &mut trials);
                    if fits(&t2) {
                        lo = Some(b2);
                    } else {
                        hi = Some(b2);
                    }
                    if let Some(p2) = t2.peak_bytes.filter(|_| !t2.oom) {
                        fit = Some(line(b1, p1, b2, p2));
                    }
                } else if b1 == max {
                    return finish(trials, lo, fit, method);
                }
            }
            // No peak measured: grow geometrically until something fails.
            None => method = "bisection",
        }
    }

    // Prediction from the line and a confirming run; a miss that still
    // measured a peak refits the line through the two nearest points once.
    for round in 0..2 {
        let Some((fixed, slope)) = fit else { break };
        let l = lo.unwrap_or(1);
        let h = hi.unwrap_or(max + 1);
        let predicted = aim((fixed, slope), budget, max).min(h - 1);
        if predicted <= l {
            break;
        }
        let t = run(predicted, &mut trials);
        if fits(&t) {
            lo = Some(predicted);
            if hi.is_none() {
                // Refit through the two points furthest apart: the first run
                // and this one. Only a clearly larger prediction earns a run.
                let first = trials
                    .iter()
                    .filter(|t| t.ok)
                    .min_by_key(|t| t.batch)
                    .map(|t| t.batch);
                let refit = match (first, t.peak_bytes) {
                    (Some(b1), Some(p)) if b1 < predicted => {
                        peak_of(&trials, b1).map(|p1| line(b1, p1, predicted, p))
                    }
                    _ => None,
                };
                let again = refit.map(|f| aim(f, budget, max));
                match again {
                    Some(b) if round == 0 && b as f64 > predicted as f64 * 1.02 => {
                        fit = refit;
                        continue;
                    }
                    _ if !cfg.exact => return finish(trials, lo, fit, method),
                    // Exact: the next one up must be seen to fail.
                    _ if predicted >= max => return finish(trials, lo, fit, method),
                    _ => {
                        let t = run(predicted + 1, &mut trials);
                        if fits(&t) {
                            lo = Some(predicted + 1);
                        } else {
                            hi = Some(predicted + 1);
                        }
                        break;
                    }
                }
            }
        } else {
            hi = Some(predicted);
        }
        method = "bisection";
        let (Some(l), Some(h)) = (lo, hi) else { break };
        fit = match (peak_of(&trials, l), peak_of(&trials, h)) {
            (Some(pl), Some(ph)) if h > l => Some(line(l, pl, h, ph)),
            _ => None,
        };
    }

    // Geometric growth when nothing has failed yet and the model could not be used.
    while hi.is_none() {
        let l = lo.unwrap_or(1);
        if l >= max {
            return finish(trials, lo, fit, method);
        }
        let b = (l * 2).min(max);
        let t = run(b, &mut trials);
        if fits(&t) {
            lo = Some(b);
        } else {
            hi = Some(b);
        }
    }

    // Between the largest fit and the smallest failure, to within 4%: where
    // both ends have a measured peak, aim just under where the line through
    // them meets the budget (false position), alternating with bisection so
    // that curved and stepped curves, where aiming creeps, still converge.
    // A fit whose peak already fills the budget to within the aim's 1% is
    // the answer: no larger batch can be confirmed without noise deciding.
    let mut l = lo.unwrap_or(0);
    let mut h = hi.unwrap_or(max + 1);
    let mut aim_next = true;
    let full = |trials: &[Trial], l: u64| {
        peak_of(trials, l).is_some_and(|p| p as f64 >= budget as f64 * AIM_UNDER)
    };
    let close_enough = |l: u64, h: u64, trials: &[Trial]| {
        !cfg.exact && ((h - l) as f64 <= l as f64 * BRACKET || full(trials, l))
    };
    while h - l > 1 && !close_enough(l, h, &trials) {
        let aimed = match (peak_of(&trials, l), peak_of(&trials, h)) {
            (Some(pl), Some(ph)) if l > 0 && ph > pl && aim_next => {
                // A crossing at or below the largest fit says nothing new: bisect instead.
                Some(aim(line(l, pl, h, ph), budget, max)).filter(|b| *b > l && *b < h)
            }
            _ => None,
        };
        let b = aimed.unwrap_or(l + (h - l) / 2);
        let t = run(b, &mut trials);
        if fits(&t) {
            l = b;
        } else {
            h = b;
        }
        aim_next = aimed.is_none();
    }
    finish(trials, (l > 0).then_some(l), fit, method)
}

/// What one run measured where every run finishes and measures what it
/// needs, whether it fits or not (`oomkit preflight`, `oomkit.preflight`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Measured {
    /// Nothing failed within the capacity.
    pub fits: bool,
    /// The most it reserved: within the capacity where it fits, else what it needs without a limit.
    pub peak_bytes: u64,
}

/// What [`largest_that_fits`] found: the largest micro-batch that fits
/// (`None`: not even 1), and every one tried with whether it fitted, by size.
pub type Largest = (Option<u64>, Vec<(u64, bool)>);

/// The exact largest micro-batch from `start` up to `max` that fits
/// `capacity`, running `measure` at each one tried (each at most once):
/// the project's one search, exact because such runs take seconds. Stops
/// at the first error `measure` returns, and returns it. Otherwise the
/// largest that fits (`None`: not even 1) and every micro-batch tried with
/// whether it fitted, by size.
pub fn largest_that_fits<E>(
    start: u64,
    max: u64,
    capacity: u64,
    measure: &mut dyn FnMut(u64) -> Result<Measured, E>,
) -> Result<Largest, E> {
    let cfg = SearchConfig {
        start,
        max,
        capacity_bytes: capacity,
        margin: 0.0,
        exact: true,
    };
    let mut failure = None;
    let result = search(&cfg, &mut |b| {
        if failure.is_some() {
            // Something failed: every later run is taken as not fitting, and the search ends soon.
            return Trial {
                batch: b,
                ok: false,
                oom: true,
                peak_bytes: None,
            };
        }
        match measure(b) {
            Ok(m) => Trial {
                batch: b,
                ok: m.fits,
                // The run finished either way: its peak is what the batch needs.
                oom: false,
                peak_bytes: Some(m.peak_bytes),
            },
            Err(e) => {
                failure = Some(e);
                Trial {
                    batch: b,
                    ok: false,
                    oom: true,
                    peak_bytes: None,
                }
            }
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    let mut tried: Vec<(u64, bool)> = result.trials.iter().map(|t| (t.batch, t.ok)).collect();
    tried.sort_unstable();
    Ok((result.recommended_batch, tried))
}

/// The batch a fitted line `(fixed, per_sample)` predicts for `budget`, aimed under it and capped at `max`.
fn aim((fixed, slope): (f64, f64), budget: u64, max: u64) -> u64 {
    if slope <= 0.0 {
        return max;
    }
    (((budget as f64 - fixed) / slope * AIM_UNDER)
        .floor()
        .max(0.0) as u64)
        .min(max)
}

fn finish(
    trials: Vec<Trial>,
    recommended: Option<u64>,
    fit: Option<(f64, f64)>,
    method: &'static str,
) -> SearchResult {
    SearchResult {
        trials,
        recommended_batch: recommended,
        fixed_bytes: fit.map(|f| f.0),
        per_sample_bytes: fit.map(|f| f.1),
        method,
    }
}

/// Lightning's `binsearch` batch finder, run against the same probe, for the benchmark.
///
/// It doubles from `start` until a run fails, then bisects to a gap of one.
pub fn lightning_binsearch(
    cfg: &SearchConfig,
    probe: &mut dyn FnMut(u64) -> Trial,
) -> SearchResult {
    let budget = cfg.budget();
    let mut trials = Vec::new();
    let mut low = 1u64;
    let mut high: Option<u64> = None;
    let mut size = cfg.start.max(1);
    for _ in 0..25 {
        let mut t = probe(size);
        t.batch = size;
        if t.peak_bytes.is_some_and(|p| p > budget) {
            t.ok = false;
        }
        trials.push(t);
        if t.ok {
            low = size;
            match high {
                Some(h) => {
                    if h - low <= 1 {
                        break;
                    }
                    size = (h + low) / 2;
                }
                None => size *= 2,
            }
        } else {
            high = Some(size);
            size = (size + low) / 2;
            if size <= low || high.is_some_and(|h| h - low <= 1) {
                break;
            }
        }
    }
    let ok = trials.iter().filter(|t| t.ok).map(|t| t.batch).max();
    finish(trials, ok, None, "binsearch")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn affine(fixed: u64, per: u64, cap: u64) -> impl FnMut(u64) -> Trial {
        move |b| {
            let m = fixed + per * b;
            Trial {
                batch: b,
                ok: m <= cap,
                oom: m > cap,
                peak_bytes: (m <= cap).then_some(m),
            }
        }
    }

    /// Where runs are cheap (preflight), the answer is exact: the largest
    /// batch that fits, with the next one up seen to fail, on curves that
    /// are affine, have a fixed step, or measure the peak of a failing run
    /// too (preflight's runs all finish, whatever they need).
    #[test]
    fn an_exact_search_finds_the_largest_batch_and_sees_the_next_fail() {
        let mib = 1u64 << 20;
        let cap = 24 * 1024 * mib;
        let cfg = |start: u64, max: u64| SearchConfig {
            start,
            max,
            capacity_bytes: cap,
            margin: 0.0,
            exact: true,
        };
        let measured = |fixed: u64, per: u64, step: u64| {
            move |b: u64| {
                let m = fixed + per * b + (b / 7) * step;
                Trial {
                    batch: b,
                    ok: m <= cap,
                    oom: false,
                    peak_bytes: Some(m),
                }
            }
        };
        for (fixed, per, step, start, max) in [
            (2000 * mib, 950 * mib, 0, 8, 64),
            (2000 * mib, 950 * mib, 300 * mib, 8, 64),
            (9000 * mib, 40 * mib, 0, 1, 4096),
            (23 * 1024 * mib, 300 * mib, 0, 8, 64),
            (30 * 1024 * mib, 10 * mib, 0, 8, 64),
            (100 * mib, mib, 0, 4, 64),
        ] {
            let mut probe = measured(fixed, per, step);
            let truth = (1..=max).rev().find(|&b| probe(b).ok);
            let r = search(&cfg(start, max), &mut probe);
            assert_eq!(
                r.recommended_batch, truth,
                "{fixed} {per} {step}: {:?}",
                r.trials
            );
            if let Some(t) = truth.filter(|&t| t < max) {
                assert!(
                    r.trials.iter().any(|x| x.batch == t + 1 && !x.ok),
                    "{:?}",
                    r.trials
                );
            }
        }
        // An affine curve: the line from two runs lands on it, one more confirms.
        let r = search(&cfg(8, 64), &mut measured(2000 * mib, 950 * mib, 0));
        assert!(r.trials.len() <= 5, "{:?}", r.trials);
    }

    #[test]
    fn a_cliff_whose_failures_report_where_they_died_is_bisected() {
        // A planted allocator failure above 16: a failing run dies at once,
        // and the tracker's probe reports the little it used by then.
        let gib = 1u64 << 30;
        let cfg = SearchConfig {
            start: 1,
            max: 128,
            capacity_bytes: 64 * gib,
            margin: 0.1,
            exact: false,
        };
        let mut cliff = |b: u64| Trial {
            batch: b,
            ok: b <= 16,
            oom: b > 16,
            peak_bytes: Some(if b <= 16 {
                700 * (1 << 20) + b * (1 << 20)
            } else {
                690 << 20
            }),
        };
        let r = search(&cfg, &mut cliff);
        assert_eq!(r.recommended_batch, Some(16));
        let tried: Vec<u64> = r.trials.iter().map(|t| t.batch).collect();
        // Never the step-by-one walk down from the first failure that a line
        // through a failure's peak gave (83, 82, 81, ...).
        assert!(r.trials.len() <= 8, "{tried:?}");
    }

    #[test]
    fn affine_curve_in_three_runs() {
        let gib = 1u64 << 30;
        let cfg = SearchConfig {
            start: 1,
            max: 100_000,
            capacity_bytes: 80 * gib,
            margin: 0.1,
            exact: false,
        };
        let r = search(&cfg, &mut affine(10 * gib, 300 << 20, 80 * gib));
        let truth = (cfg.budget() - 10 * gib) / (300 << 20);
        let got = r.recommended_batch.expect("fits");
        assert!(
            got <= truth && got as f64 >= truth as f64 * 0.98,
            "{got} vs {truth}"
        );
        assert!(r.trials.len() <= 3, "{:?}", r.trials);
    }

    #[test]
    fn start_too_big_steps_down() {
        let gib = 1u64 << 30;
        let cfg = SearchConfig {
            start: 512,
            max: 4096,
            capacity_bytes: 24 * gib,
            margin: 0.0,
            exact: false,
        };
        let r = search(&cfg, &mut affine(2 * gib, 200 << 20, 24 * gib));
        let truth = (22 * gib) / (200 << 20);
        assert_eq!(r.recommended_batch, Some(truth));
    }

    #[test]
    fn nothing_fits() {
        let cfg = SearchConfig {
            start: 8,
            max: 64,
            capacity_bytes: 1 << 30,
            margin: 0.0,
            exact: false,
        };
        let r = search(&cfg, &mut affine(2 << 30, 1, 1 << 30));
        assert_eq!(r.recommended_batch, None);
        assert_eq!(
            r.trials.iter().map(|t| t.batch).collect::<Vec<_>>(),
            vec![8, 4, 2, 1]
        );
    }

    #[test]
    fn binsearch_matches_on_affine() {
        let gib = 1u64 << 30;
        let cfg = SearchConfig {
            start: 2,
            max: 100_000,
            capacity_bytes: 40 * gib,
            margin: 0.0,
            exact: false,
        };
        let r = lightning_binsearch(&cfg, &mut affine(4 * gib, 100 << 20, 40 * gib));
        assert_eq!(r.recommended_batch, Some(36 * gib / (100 << 20)));
        assert!(r.trials.len() > 6);
    }
}
