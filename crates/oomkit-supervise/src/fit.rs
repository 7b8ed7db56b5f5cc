//! The largest micro-batch that the OOM messages of earlier attempts leave possible.
//!
//! Each capacity OOM at micro-batch `b` says the process needed at least
//! `held + request` bytes and had `held + free` within reach. If everything
//! grew in proportion to the batch, `b x room / need` would fit; a fixed part
//! (weights, optimizer state) only makes fewer fit, so that is an upper bound,
//! and the smallest over all the OOMs so far is the largest micro-batch not
//! yet ruled out. A line fitted through two OOMs would be tighter only if
//! both failed at the same point of the step: a larger batch usually fails
//! earlier, with less held, so such a line can fall below what really fits.

use crate::explain::Explanation;
use crate::oom::Cause;

/// What one capacity OOM said about memory at one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Observation {
    /// The micro-batch that ran out.
    pub micro_batch: u64,
    /// Bytes it needed at least: what the process held plus the failed request.
    pub need: u64,
    /// Bytes within its reach: what it held plus what the device had free.
    pub room: u64,
}

/// The observation in an explained OOM, where it is a capacity failure with all the figures.
pub fn observe(e: &Explanation, micro_batch: u64) -> Option<Observation> {
    if e.cause != Cause::Capacity || micro_batch == 0 {
        return None;
    }
    let m = &e.message;
    let held = m.process_bytes.or_else(|| {
        m.allocated_bytes
            .map(|a| a + m.reserved_unallocated_bytes.unwrap_or(0))
    })?;
    let need = held.checked_add(m.requested_bytes?)?;
    let room = held.checked_add(m.free_bytes?)?;
    (need > room).then_some(Observation {
        micro_batch,
        need,
        room,
    })
}

/// The largest micro-batch the observations leave possible, always below every one that ran out, or `None` without one.
pub fn predicted_fit(observations: &[Observation]) -> Option<u64> {
    observations
        .iter()
        .map(|o| {
            let bound = (o.micro_batch as u128 * o.room as u128 / o.need as u128) as u64;
            bound.min(o.micro_batch - 1)
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn obs(micro_batch: u64, need_gib: u64, room_gib: u64) -> Observation {
        Observation {
            micro_batch,
            need: need_gib * GIB,
            room: room_gib * GIB,
        }
    }

    #[test]
    fn one_point_gives_the_proportional_bound() {
        // 76 GiB needed at 64 with 20 in reach: at most 16 if nothing is fixed.
        assert_eq!(predicted_fit(&[obs(64, 76, 20)]), Some(16));
    }

    #[test]
    fn the_tightest_bound_wins() {
        assert_eq!(predicted_fit(&[obs(64, 76, 20), obs(16, 20, 19)]), Some(15));
        assert_eq!(predicted_fit(&[obs(16, 17, 16), obs(64, 76, 20)]), Some(15));
    }

    #[test]
    fn never_reaches_a_batch_that_ran_out() {
        assert_eq!(predicted_fit(&[obs(32, 80, 79), obs(16, 80, 79)]), Some(15));
        assert_eq!(predicted_fit(&[obs(8, 9, 8)]), Some(7));
        assert_eq!(predicted_fit(&[]), None);
    }
}
