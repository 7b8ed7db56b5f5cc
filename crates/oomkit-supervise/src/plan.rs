//! The micro-batch and gradient accumulation to use after an OOM, chosen so
//! that micro-batch x accumulation still covers the effective batch.

use serde::Serialize;

/// One micro-batch and accumulation pair, and the effective batch it serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct BatchPlan {
    /// Samples per forward and backward pass.
    pub micro_batch: u64,
    /// Micro-batches per optimizer step.
    pub grad_accum: u64,
    /// The samples per optimizer step the user asked for.
    pub effective_batch: u64,
}

impl BatchPlan {
    /// The plan for a micro-batch and an effective batch, with accumulation rounded up to cover it.
    pub fn new(micro_batch: u64, effective_batch: u64) -> BatchPlan {
        let micro_batch = micro_batch.max(1);
        BatchPlan {
            micro_batch,
            grad_accum: effective_batch.div_ceil(micro_batch).max(1),
            effective_batch,
        }
    }

    /// Samples per optimizer step this plan really gives.
    pub fn actual_effective(&self) -> u64 {
        self.micro_batch * self.grad_accum
    }

    /// Whether the plan gives exactly the effective batch asked for.
    pub fn is_exact(&self) -> bool {
        self.actual_effective() == self.effective_batch
    }

    /// The next plan down after an OOM, or `None` when the micro-batch is already at `min_micro_batch`.
    ///
    /// The micro-batch is halved; where a divisor of the effective batch lies
    /// between three quarters of that half and the half itself, it is taken
    /// instead, so that the effective batch stays exact whenever it can.
    pub fn back_off(&self, min_micro_batch: u64) -> Option<BatchPlan> {
        self.back_off_to(self.micro_batch / 2, min_micro_batch)
    }

    /// Like [`BatchPlan::back_off`], but to at most `target` when that is below half the micro-batch.
    pub fn back_off_to(&self, target: u64, min_micro_batch: u64) -> Option<BatchPlan> {
        let floor = min_micro_batch.max(1);
        if self.micro_batch <= floor {
            return None;
        }
        let half = (self.micro_batch / 2).min(target).max(floor);
        let lowest = (half * 3).div_ceil(4).max(floor);
        let exact = (lowest..=half)
            .rev()
            .find(|d| self.effective_batch.is_multiple_of(*d));
        Some(BatchPlan::new(exact.unwrap_or(half), self.effective_batch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn halves_and_doubles() {
        let p = BatchPlan::new(32, 128);
        assert_eq!(p.grad_accum, 4);
        let q = p.back_off(1).expect("smaller");
        assert_eq!((q.micro_batch, q.grad_accum), (16, 8));
        assert!(q.is_exact());
    }

    #[test]
    fn prefers_an_exact_divisor() {
        // Half of 24 is 12, which does not divide 100; 10 does and is within reach.
        let p = BatchPlan::new(24, 100).back_off(1).expect("smaller");
        assert_eq!((p.micro_batch, p.grad_accum), (10, 10));
        assert!(p.is_exact());
    }

    #[test]
    fn rounds_up_when_it_cannot_be_exact() {
        // 97 is prime: no divisor near 8, so accumulation rounds up and the plan says so.
        let p = BatchPlan::new(16, 97).back_off(1).expect("smaller");
        assert_eq!((p.micro_batch, p.grad_accum), (8, 13));
        assert_eq!(p.actual_effective(), 104);
        assert!(!p.is_exact());
    }

    #[test]
    fn jumps_below_half_when_told_and_never_above_it() {
        let p = BatchPlan::new(64, 64);
        assert_eq!(p.back_off_to(16, 1).map(|q| q.micro_batch), Some(16));
        assert_eq!(p.back_off_to(60, 1).map(|q| q.micro_batch), Some(32));
        assert_eq!(p.back_off_to(0, 4).map(|q| q.micro_batch), Some(4));
    }

    #[test]
    fn stops_at_the_floor() {
        assert_eq!(BatchPlan::new(4, 16).back_off(4), None);
        let p = BatchPlan::new(5, 20).back_off(4).expect("smaller");
        assert_eq!(p.micro_batch, 4);
        assert_eq!(BatchPlan::new(1, 8).back_off(1), None);
    }

    proptest! {
        #[test]
        fn always_covers_the_effective_batch(micro in 1u64..4096, eff_mult in 1u64..64, min in 1u64..8) {
            let eff = micro * eff_mult;
            let mut plan = BatchPlan::new(micro, eff);
            while let Some(next) = plan.back_off(min) {
                prop_assert!(next.micro_batch < plan.micro_batch);
                prop_assert!(next.micro_batch >= min.min(plan.micro_batch));
                prop_assert!(next.actual_effective() >= eff);
                prop_assert!(next.actual_effective() < eff + next.micro_batch);
                plan = next;
            }
        }
    }
}
