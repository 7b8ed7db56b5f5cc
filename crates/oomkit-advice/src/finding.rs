//! Findings: a conclusion, its evidence in numbers, and what to change,
//! with one vocabulary of kinds and one ranking for snapshots and run logs.

use crate::role::Role;
use serde::Serialize;

/// What a finding is about; the JSON strings are the finding vocabulary of docs/json.md and docs/tracker.md.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// A run log's OOM record.
    Oom,
    /// A snapshot's OOM entry where the device was full.
    OomCapacity,
    /// A snapshot's OOM entry where reserved pieces could have held the request.
    OomFragmentation,
    /// End-of-step memory grows steadily after warm-up.
    Leak,
    /// Tensors mirror the model's parameters: a second copy of the weights.
    DuplicateCopy,
    /// A phase peaks well above the training before it.
    EvalSpike,
    /// A snapshot phase ends with much more live than it began with.
    PhaseRetainsMemory,
    /// A gradient check found NaN or Inf.
    GradNonfinite,
    /// A gradient norm far above the median.
    GradSpike,
    /// One source line holds a large share of the peak.
    DominantSite,
    /// One role (parameters, gradients, optimizer state, activations, ...) holds a large share of the peak.
    DominantRole,
    /// Activations hold at least half the peak.
    ActivationsDominate,
    /// Optimizer state is large against the device or the parameters.
    OptimizerStateLarge,
    /// Gradients stay allocated into the next step.
    GradsHeldBetweenSteps,
    /// The EMA copy lives on the GPU.
    EmaOnDevice,
    /// Free memory inside segments that no request of this program can use.
    Fragmentation,
    /// Memory freed but held for other streams.
    PendingFree,
    /// The allocator reserved much more than the program ever used.
    ReservedOverhead,
}

impl FindingKind {
    /// Every kind, most urgent first: the ranking.
    pub const BY_URGENCY: [FindingKind; 18] = [
        FindingKind::Oom,
        FindingKind::OomCapacity,
        FindingKind::OomFragmentation,
        FindingKind::Leak,
        FindingKind::DuplicateCopy,
        FindingKind::EvalSpike,
        FindingKind::PhaseRetainsMemory,
        FindingKind::GradNonfinite,
        FindingKind::GradSpike,
        FindingKind::DominantSite,
        FindingKind::DominantRole,
        FindingKind::ActivationsDominate,
        FindingKind::OptimizerStateLarge,
        FindingKind::GradsHeldBetweenSteps,
        FindingKind::EmaOnDevice,
        FindingKind::Fragmentation,
        FindingKind::PendingFree,
        FindingKind::ReservedOverhead,
    ];

    /// The kind as its JSON string, for text that names it.
    pub fn as_str(self) -> &'static str {
        match self {
            FindingKind::Oom => "oom",
            FindingKind::OomCapacity => "oom_capacity",
            FindingKind::OomFragmentation => "oom_fragmentation",
            FindingKind::Leak => "leak",
            FindingKind::DuplicateCopy => "duplicate_copy",
            FindingKind::EvalSpike => "eval_spike",
            FindingKind::PhaseRetainsMemory => "phase_retains_memory",
            FindingKind::GradNonfinite => "grad_nonfinite",
            FindingKind::GradSpike => "grad_spike",
            FindingKind::DominantSite => "dominant_site",
            FindingKind::DominantRole => "dominant_role",
            FindingKind::ActivationsDominate => "activations_dominate",
            FindingKind::OptimizerStateLarge => "optimizer_state_large",
            FindingKind::GradsHeldBetweenSteps => "grads_held_between_steps",
            FindingKind::EmaOnDevice => "ema_on_device",
            FindingKind::Fragmentation => "fragmentation",
            FindingKind::PendingFree => "pending_free",
            FindingKind::ReservedOverhead => "reserved_overhead",
        }
    }

    /// Where the kind stands in [`FindingKind::BY_URGENCY`]: an OOM first,
    /// then what grows or is held twice (it will cause the next OOM), then
    /// bad numerics, then where the memory goes, then allocator settings.
    /// The OOM kinds share the first place, so OOMs rank among themselves by bytes.
    pub fn urgency(self) -> usize {
        let kind = match self {
            FindingKind::OomCapacity | FindingKind::OomFragmentation => FindingKind::Oom,
            k => k,
        };
        Self::BY_URGENCY
            .iter()
            .position(|k| *k == kind)
            .unwrap_or(usize::MAX)
    }
}

impl std::fmt::Display for FindingKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A conclusion with its evidence and what to change.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    /// What it is about.
    pub kind: FindingKind,
    /// The CUDA device it concerns, for snapshots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<i64>,
    /// What was found, with numbers.
    pub message: String,
    /// What to change.
    pub advice: String,
    /// The bytes at stake, where they apply.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Bytes added per step, for leaks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_per_step: Option<f64>,
    /// The step it concerns, where one does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// The trace entry it concerns, for a snapshot's OOM: its index in the device's trace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event: Option<u64>,
    /// The role of the memory it is about, where one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// What replaying the trace with the recommended fix showed, where a trace was replayed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replayed: Option<Replayed>,
}

/// What replaying a snapshot's trace through the model of the caching
/// allocator, with the fix a finding recommends, showed (`oomkit whatif`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Replayed {
    /// The allocator settings replayed, in `PYTORCH_CUDA_ALLOC_CONF`'s syntax.
    pub settings: String,
    /// The peak reserved with them.
    pub peak_reserved_bytes: u64,
    /// The peak reserved it is compared with: as recorded, or with the
    /// blocks from before the trace placed afresh where the fix's are.
    pub baseline_peak_reserved_bytes: u64,
    /// The recorded OOM it is about, if any: the entry in the device's trace.
    pub oom_event: Option<usize>,
    /// Whether that OOM still happens with the fix.
    pub oom_happens: Option<bool>,
    /// Whether the fix helps: it avoids the OOM, or lowers the peak.
    pub helps: bool,
    /// Where the fix does not avoid the OOM: what the replay found that does, in words.
    pub alternative: Option<String>,
    /// Share of the trace's own segments the model made as recorded (1: all);
    /// below 1 the figures are the model's more than the run's.
    pub model_agreement: f64,
}

impl Finding {
    /// A finding with its kind, message and advice, and no numbers yet.
    pub fn new(kind: FindingKind, message: String, advice: impl Into<String>) -> Finding {
        Finding {
            kind,
            device: None,
            message,
            advice: advice.into(),
            bytes: None,
            bytes_per_step: None,
            step: None,
            event: None,
            role: None,
            replayed: None,
        }
    }

    /// The same finding, about memory of `role`.
    pub fn about_role(mut self, role: Role) -> Finding {
        self.role = Some(role);
        self
    }

    /// The same finding, about `device`.
    pub fn on_device(mut self, device: i64) -> Finding {
        self.device = Some(device);
        self
    }

    /// The same finding, with the bytes at stake.
    pub fn with_bytes(mut self, bytes: u64) -> Finding {
        self.bytes = Some(bytes);
        self
    }

    /// The same finding, about the trace entry `event`.
    pub fn at_event(mut self, event: u64) -> Finding {
        self.event = Some(event);
        self
    }

    /// The same finding, about `step` where one is known.
    pub fn at_step(mut self, step: Option<u64>) -> Finding {
        self.step = step;
        self
    }
}

/// Orders findings the one way every report shows them: by urgency, then
/// the most bytes at stake first; findings that tie keep their order.
pub fn rank(findings: &mut [Finding]) {
    findings.sort_by(|a, b| {
        a.kind
            .urgency()
            .cmp(&b.kind.urgency())
            .then(b.bytes.unwrap_or(0).cmp(&a.bytes.unwrap_or(0)))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_ranked_once_and_named_as_serde_names_it() {
        for (i, k) in FindingKind::BY_URGENCY.iter().enumerate() {
            assert!(k.urgency() <= i);
            assert_eq!(
                serde_json::to_string(k).expect("serializes"),
                format!("\"{}\"", k.as_str())
            );
        }
    }

    #[test]
    fn urgency_first_then_bytes() {
        let f = |kind, bytes| Finding::new(kind, String::new(), "").with_bytes(bytes);
        let mut v = vec![
            f(FindingKind::Fragmentation, 900),
            f(FindingKind::DominantSite, 10),
            f(FindingKind::OomCapacity, 1),
            f(FindingKind::DominantSite, 20),
        ];
        rank(&mut v);
        let got: Vec<(FindingKind, Option<u64>)> = v.iter().map(|f| (f.kind, f.bytes)).collect();
        assert_eq!(
            got,
            [
                (FindingKind::OomCapacity, Some(1)),
                (FindingKind::DominantSite, Some(20)),
                (FindingKind::DominantSite, Some(10)),
                (FindingKind::Fragmentation, Some(900)),
            ]
        );
    }
}
