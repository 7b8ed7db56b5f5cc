//! The GPUs `oomkit run` gives the command: chosen and claimed for the
//! first attempt, and again, leaving some out, when another process took
//! the memory.

use crate::child;
use crate::run::{RunOptions, UNMANAGED_MODEL};
use crate::SuperviseError;
use oomkit_gpu::{acquire, GpuError, Held, Request};
use oomkit_units::human_bytes;

/// The GPUs of the first attempt, their claim, and the GPU model the plan memory is kept under.
#[allow(clippy::type_complexity)]
pub(crate) fn first_gpus(
    opts: &RunOptions,
    stopped_by: &std::cell::Cell<i32>,
    say: &mut dyn FnMut(&str),
) -> Result<(Option<Vec<u32>>, Option<Held>, String), SuperviseError> {
    if opts.gpus == 0 {
        return Ok((None, None, UNMANAGED_MODEL.to_string()));
    }
    match take_gpus(opts, &[], stopped_by, say) {
        Ok((ids, model, h)) => Ok((Some(ids), Some(h), model)),
        Err(e) if e.is_absent() && !opts.require_gpu => {
            say(&format!(
                "warning: {e}; running the command without choosing a GPU (--require-gpu makes this an error)"
            ));
            Ok((None, None, UNMANAGED_MODEL.to_string()))
        }
        Err(GpuError::Stopped) => Err(SuperviseError::Interrupted(stopped_by.get())),
        Err(e) => Err(e.into()),
    }
}

/// Chooses and claims the GPUs the job asks for, leaving out `avoid`; a signal
/// that ends the wait is left in `stopped_by`, for the error that reports it.
pub(crate) fn take_gpus(
    opts: &RunOptions,
    avoid: &[u32],
    stopped_by: &std::cell::Cell<i32>,
    say: &mut dyn FnMut(&str),
) -> Result<(Vec<u32>, String, Held), GpuError> {
    let req = Request {
        count: opts.gpus,
        min_free: opts.min_free,
        exclude: avoid.to_vec(),
    };
    let stop = || match child::take_signal() {
        Some(sig) => {
            stopped_by.set(sig);
            true
        }
        None => false,
    };
    let a = acquire(&req, &opts.claims, opts.wait, &mut |m| say(m), &stop)?;
    let names: Vec<String> = a
        .gpus
        .iter()
        .map(|g| {
            format!(
                "GPU {} ({}, {} free)",
                g.index,
                g.name,
                human_bytes(g.free_bytes)
            )
        })
        .collect();
    say(&format!("using {}", names.join(", ")));
    let model = a.gpus.first().map(|g| g.name.clone()).unwrap_or_default();
    Ok((a.gpus.iter().map(|g| g.index).collect(), model, a.held))
}

/// GPU indices as a list for a sentence (`0,2`).
pub(crate) fn join(ids: &[u32]) -> String {
    ids.iter()
        .map(|g| g.to_string())
        .collect::<Vec<_>>()
        .join(",")
}
