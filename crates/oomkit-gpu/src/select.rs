//! Choosing GPUs for a job, and waiting until enough of them qualify.

use crate::claim::{claim_for, Claim, ClaimDir, Held};
use crate::{gpu_key, probe, Gpu, GpuError};
use oomkit_units::{human_bytes, human_duration};
use std::time::{Duration, Instant};

/// What a job needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// How many GPUs.
    pub count: usize,
    /// Free memory each GPU must have; `None` asks for whole GPUs that no other oomkit job holds.
    pub min_free: Option<u64>,
    /// GPU indices not to choose, such as one where another process took the memory.
    pub exclude: Vec<u32>,
}

/// How long to wait for GPUs, and how often to look.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Wait {
    /// Give up after this long; zero means look once.
    pub timeout: Duration,
    /// Time between looks.
    pub poll: Duration,
}

/// GPUs handed to a job, with the claims that keep other jobs off them.
#[derive(Debug)]
pub struct Acquired {
    /// The chosen GPUs, most free memory first, as they were when chosen.
    pub gpus: Vec<Gpu>,
    /// The claims; dropping this releases them.
    pub held: Held,
}

/// Free memory on `gpu` once live claims are taken off, or `None` when an exclusive claim holds it.
fn available(gpu: &Gpu, claims: &[Claim]) -> Option<u64> {
    let key = gpu_key(gpu);
    let mut free = gpu.free_bytes;
    for c in claims.iter().filter(|c| c.gpu == key) {
        let owed = c.outstanding(gpu.free_bytes);
        if owed == u64::MAX {
            return None;
        }
        free = free.saturating_sub(owed);
    }
    Some(free)
}

/// Picks the GPUs for `req`: the ones with the most available memory, or the reason none qualify.
pub fn choose<'g>(
    gpus: &'g [Gpu],
    claims: &[Claim],
    req: &Request,
) -> Result<Vec<&'g Gpu>, String> {
    let mut ranked: Vec<(&Gpu, u64)> = gpus
        .iter()
        .filter(|g| !req.exclude.contains(&g.index))
        .filter_map(|g| available(g, claims).map(|a| (g, a)))
        .collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.index.cmp(&b.0.index)));
    let claimed = gpus.len() - ranked.len();
    let qualified: Vec<&Gpu> = ranked
        .iter()
        .filter(|(_, a)| req.min_free.is_none_or(|m| *a >= m))
        .map(|(g, _)| *g)
        .take(req.count)
        .collect();
    if qualified.len() >= req.count {
        return Ok(qualified);
    }
    let need = match req.min_free {
        Some(m) => format!("{} GPU(s) with {} free", req.count, human_bytes(m)),
        None => format!("{} GPU(s) not held by another oomkit job", req.count),
    };
    let best = ranked
        .first()
        .map(|(g, a)| {
            format!(
                "; the most available is GPU {} with {}",
                g.index,
                human_bytes(*a)
            )
        })
        .unwrap_or_default();
    let held = if claimed > 0 {
        format!(", {claimed} held by other oomkit jobs")
    } else {
        String::new()
    };
    Err(format!(
        "need {need}: {} of {} qualify{held}{best}",
        qualified.len(),
        gpus.len()
    ))
}

/// Chooses and claims GPUs for `req`, waiting for them as `wait` allows.
///
/// `on_wait` hears why it waits; `stop` is asked often while it sleeps and ends the wait when true.
pub fn acquire(
    req: &Request,
    dir: &ClaimDir,
    wait: Wait,
    on_wait: &mut dyn FnMut(&str),
    stop: &dyn Fn() -> bool,
) -> Result<Acquired, GpuError> {
    let started = Instant::now();
    let mut last_reason = String::new();
    loop {
        let locked = dir.lock()?;
        let gpus = probe()?;
        if req.count > gpus.len() {
            return Err(GpuError::Unsatisfiable(format!(
                "asked for {} GPUs but this machine has {}",
                req.count,
                gpus.len()
            )));
        }
        if let Some(m) = req.min_free {
            if !gpus.iter().any(|g| g.total_bytes >= m) {
                return Err(GpuError::Unsatisfiable(format!(
                    "asked for {} free but the largest GPU here has {}",
                    human_bytes(m),
                    human_bytes(gpus.iter().map(|g| g.total_bytes).max().unwrap_or(0))
                )));
            }
        }
        let claims = locked.live_claims()?;
        match choose(&gpus, &claims, req) {
            Ok(picked) => {
                let new: Vec<Claim> = picked.iter().map(|g| claim_for(g, req.min_free)).collect();
                let held = locked.write(&new)?;
                return Ok(Acquired {
                    gpus: picked.into_iter().cloned().collect(),
                    held,
                });
            }
            Err(reason) => {
                drop(locked);
                let waited = started.elapsed();
                if waited + wait.poll > wait.timeout {
                    let after = if wait.timeout.is_zero() {
                        String::new()
                    } else {
                        format!(" after waiting {}", human_duration(waited))
                    };
                    return Err(GpuError::TimedOut(format!(
                        "no GPU available{after}: {reason}"
                    )));
                }
                if reason != last_reason {
                    let left = wait.timeout.saturating_sub(waited);
                    on_wait(&format!(
                        "waiting for GPUs ({reason}); looking again every {}, for up to {}",
                        human_duration(wait.poll),
                        human_duration(left)
                    ));
                    last_reason = reason;
                }
                let until = Instant::now() + wait.poll;
                while Instant::now() < until {
                    if stop() {
                        return Err(GpuError::Stopped);
                    }
                    std::thread::sleep(Duration::from_millis(50).min(wait.poll));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, free_gib: u64) -> Gpu {
        Gpu {
            index,
            name: "Test".into(),
            uuid: Some(format!("GPU-{index}")),
            total_bytes: 80 << 30,
            free_bytes: free_gib << 30,
            used_bytes: (80 - free_gib) << 30,
            utilization_percent: None,
            processes: vec![],
        }
    }

    fn claim(index: u32, reserved_gib: Option<u64>, free_at_claim_gib: u64) -> Claim {
        Claim {
            gpu: format!("GPU-{index}"),
            index,
            pid: 1,
            start_time: None,
            reserved_bytes: reserved_gib.map(|g| g << 30),
            free_at_claim: free_at_claim_gib << 30,
        }
    }

    fn indices(v: Result<Vec<&Gpu>, String>) -> Vec<u32> {
        v.expect("chosen").iter().map(|g| g.index).collect()
    }

    #[test]
    fn most_free_first() {
        let gpus = [gpu(0, 10), gpu(1, 70), gpu(2, 40)];
        let req = Request {
            count: 2,
            min_free: None,
            exclude: Vec::new(),
        };
        assert_eq!(indices(choose(&gpus, &[], &req)), vec![1, 2]);
    }

    #[test]
    fn min_free_filters() {
        let gpus = [gpu(0, 10), gpu(1, 30)];
        let req = Request {
            count: 1,
            min_free: Some(40 << 30),
            exclude: Vec::new(),
        };
        let why = choose(&gpus, &[], &req).unwrap_err();
        assert!(why.contains("GPU 1 with 30.0 GiB"), "{why}");
    }

    #[test]
    fn exclusive_claim_hides_a_gpu() {
        let gpus = [gpu(0, 80), gpu(1, 20)];
        let req = Request {
            count: 1,
            min_free: None,
            exclude: Vec::new(),
        };
        assert_eq!(indices(choose(&gpus, &[claim(0, None, 80)], &req)), vec![1]);
    }

    #[test]
    fn partial_claim_counts_until_memory_fills() {
        let req = Request {
            count: 1,
            min_free: Some(30 << 30),
            exclude: Vec::new(),
        };
        // Just claimed, nothing used yet: 80 - 50 leaves 30, which still qualifies.
        let c = claim(0, Some(50), 80);
        assert_eq!(
            indices(choose(&[gpu(0, 80)], std::slice::from_ref(&c), &req)),
            vec![0]
        );
        // A second 50 GiB claim leaves nothing.
        let c2 = claim(0, Some(50), 80);
        assert!(choose(&[gpu(0, 80)], &[c.clone(), c2], &req).is_err());
        // Once the job has filled its 50 GiB the claim no longer counts twice.
        assert_eq!(indices(choose(&[gpu(0, 30)], &[c], &req)), vec![0]);
    }

    #[test]
    fn excluded_gpus_are_never_chosen() {
        let gpus = [gpu(0, 80), gpu(1, 40)];
        let req = Request {
            count: 1,
            min_free: None,
            exclude: vec![0],
        };
        let picked = choose(&gpus, &[], &req).expect("GPU 1 qualifies");
        assert_eq!(picked[0].index, 1);
        let req = Request {
            count: 2,
            min_free: None,
            exclude: vec![0],
        };
        assert!(choose(&gpus, &[], &req).is_err());
    }
}
