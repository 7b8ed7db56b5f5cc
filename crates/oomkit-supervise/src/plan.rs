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
    /// The micro-batch is halved, or moved below the half where that keeps
    /// the effective batch exact, as [`BatchPlan::step_to`] explains.
    pub fn back_off(&self, min_micro_batch: u64) -> Option<BatchPlan> {
        self.step_to(self.micro_batch / 2, min_micro_batch)
    }

    /// The plan at micro-batch `target` (kept below the current one and at
    /// least `min_micro_batch`), or `None` when the micro-batch is already at the floor.
    ///
    /// Among the micro-batches from half the target to the target, the one
    /// whose accumulation overshoots the effective batch least is taken, the
    /// largest of those that tie: an effective batch that stays exact (or
    /// nearly) keeps the training the user tuned, which is worth more than the
    /// last samples of a micro-batch.
    pub fn step_to(&self, target: u64, min_micro_batch: u64) -> Option<BatchPlan> {
        let floor = min_micro_batch.max(1);
        if self.micro_batch <= floor {
            return None;
        }
        let target = target.min(self.micro_batch - 1).max(floor);
        let lowest = target.div_ceil(2).max(floor);
        let best = (lowest..=target)
            .rev()
            .min_by_key(|m| BatchPlan::new(*m, self.effective_batch).actual_effective())
            .unwrap_or(target);
        Some(BatchPlan::new(best, self.effective_batch))
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
    fn rounds_up_as_little_as_it_can_when_it_cannot_be_exact() {
        // 97 is prime: 8 x 13 would give 104 samples; 7 x 14 gives 98.
        let p = BatchPlan::new(16, 97).back_off(1).expect("smaller");
        assert_eq!((p.micro_batch, p.grad_accum), (7, 14));
        assert_eq!(p.actual_effective(), 98);
        assert!(!p.is_exact());
    }

    #[test]
    fn steps_to_the_largest_exact_divisor_within_half_of_the_target() {
        let p = BatchPlan::new(64, 64);
        assert_eq!(p.step_to(16, 1).map(|q| q.micro_batch), Some(16));
        assert_eq!(p.step_to(60, 1).map(|q| q.micro_batch), Some(32));
        assert_eq!(p.step_to(0, 4).map(|q| q.micro_batch), Some(4));
        // Never at or above the micro-batch that ran out.
        assert_eq!(p.step_to(100, 1).map(|q| q.micro_batch), Some(32));
        // 120 has divisors between 45 and 23: the largest, 40, is taken.
        let q = BatchPlan::new(60, 120).step_to(45, 1).expect("smaller");
        assert_eq!((q.micro_batch, q.grad_accum), (40, 3));
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
