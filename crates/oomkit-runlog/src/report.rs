//! What the analysis of a run log reports: the types behind `analyze --json`
//! for run logs, which the analysis fills and the findings read.

use crate::record::{Components, MeasureKind, Plan, Seen};
use oomkit_advice::{Cause, Finding};
use serde::Serialize;

/// Memory statistics of one stage, phase, or of whole steps.
#[derive(Clone, Debug, Serialize)]
pub struct StageStats {
    /// `stage`, `step` or `phase`.
    pub kind: MeasureKind,
    /// `forward`, `backward`, `optimizer`, `step`, or the phase's name.
    pub name: String,
    /// How many times it ran.
    pub count: u64,
    /// Mean of its peaks.
    pub mean_peak_bytes: u64,
    /// Largest peak.
    pub max_peak_bytes: u64,
    /// Mean of end minus start: what it leaves allocated (negative: frees).
    pub mean_delta_bytes: i64,
    /// Mean of peak minus start: what it needs on top of what was there.
    pub mean_rise_bytes: u64,
    /// Mean wall time in seconds.
    pub mean_seconds: f64,
    /// How many of its peaks are lower bounds: it ran while the process
    /// stayed under an earlier high-water mark, which the tracker does not reset.
    pub peaks_bounded: u64,
    /// Where a bounded peak could lie above `max_peak_bytes`, the most it could be.
    pub max_peak_at_most_bytes: Option<u64>,
}

/// The stage that needs the most memory on top of what was there when it began.
#[derive(Clone, Debug, Serialize)]
pub struct StageGrowth {
    /// Its kind.
    pub kind: MeasureKind,
    /// Its name.
    pub name: String,
    /// Mean of peak minus start.
    pub mean_rise_bytes: u64,
    /// Share of the step's peak it accounts for, 0 to 1.
    pub share_of_peak: f64,
    /// True when its rise is a lower bound (some of its peaks are).
    pub at_least: bool,
}

/// How a run ended, as its log tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ending {
    /// The tracker was closed (`tracker.close()`, a `with` block, an integration).
    Closed,
    /// The interpreter exited with the tracker open; it closed itself on the way out.
    Exit,
    /// An uncaught exception ended the program.
    Exception,
    /// The kernel's OOM killer ended the process: SIGKILL while the kernel recorded an OOM kill (`oomkit run` wrote the end record).
    KilledForMemory,
    /// A signal ended the process, with no OOM kill recorded (`oomkit run` wrote the end record).
    Killed,
    /// The log stops without an end record: the process was killed outside `oomkit run`, crashed, or is still running.
    Unfinished,
}

/// Sustained growth of end-of-step memory.
#[derive(Clone, Debug, Serialize)]
pub struct Leak {
    /// Bytes added per step (least-squares slope).
    pub bytes_per_step: f64,
    /// R² of the linear fit, 0 to 1.
    pub confidence: f64,
    /// First step of the fitted window (after warm-up).
    pub first_step: u64,
    /// Last step of the window.
    pub last_step: u64,
    /// Memory at the end of the first step of the window.
    pub start_bytes: u64,
    /// Memory at the end of the last step.
    pub end_bytes: u64,
    /// The step at which the device would be full at this rate, when its capacity is known.
    pub full_at_step: Option<u64>,
}

/// One OOM, as the log recorded it.
#[derive(Clone, Debug, Serialize)]
pub struct OomSummary {
    /// When it happened, seconds since the epoch, if the log says.
    pub time: Option<f64>,
    /// The step.
    pub step: Option<u64>,
    /// The stage or phase that was running.
    pub stage: Option<String>,
    /// Bytes the failed allocation asked for.
    pub requested_bytes: Option<u64>,
    /// Bytes held by tensors then.
    pub allocated_bytes: u64,
    /// Bytes reserved by the allocator then.
    pub reserved_bytes: u64,
    /// Why it failed, decided from the allocator's figures as `oomkit explain` decides it.
    pub cause: Cause,
    /// The snapshot dumped at the OOM, if any.
    pub snapshot: Option<String>,
    /// True where the kernel's OOM killer ended the process (SIGKILL: no
    /// error was raised, `oomkit run` wrote the end record): host memory ran
    /// out; `allocated_bytes` is what the last record held.
    pub killed_by_kernel: bool,
}

impl OomSummary {
    /// What the verdict and the findings know of this OOM.
    pub(crate) fn failure(
        &self,
        device: &str,
        rank: Option<u32>,
        capacity: Option<u64>,
    ) -> oomkit_advice::Failure {
        oomkit_advice::Failure {
            place: oomkit_advice::Place {
                device: (!device.is_empty()).then(|| device.to_string()),
                rank,
                step: self.step,
                stage: self.stage.clone(),
                ..Default::default()
            },
            figures: oomkit_advice::Figures {
                requested: self.requested_bytes,
                capacity,
                // The log does not say what the driver had free (the CUDA context
                // and other processes hold some), so no shortfall is claimed.
                free: None,
                reserved_unallocated: Some(
                    self.reserved_bytes.saturating_sub(self.allocated_bytes),
                ),
                ..Default::default()
            },
            live: Some(self.allocated_bytes),
            site: None,
            expandable_segments: false,
            // The tracker does not split an OOM's live bytes by role.
            largest_role: None,
        }
    }
}

/// A limit of the evidence.
#[derive(Clone, Debug, Serialize)]
pub struct Warning {
    /// Stable identifier.
    pub kind: &'static str,
    /// What is missing or doubtful.
    pub message: String,
}

/// Everything oomkit concludes from one run log.
#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    /// What failed, where, why and the first fix; or the peak and the most important finding.
    pub verdict: oomkit_advice::Verdict,
    /// Always `run`, to tell it from a snapshot's analysis.
    pub kind: &'static str,
    /// Steps recorded.
    pub steps: u64,
    /// Rank of the process that wrote the log.
    pub rank: u32,
    /// `cuda:N` or `cpu`.
    pub device: String,
    /// Device capacity in bytes, when known.
    pub capacity_bytes: Option<u64>,
    /// The most memory measured in use: of any step, stage or phase, at an
    /// OOM, or (with none of those) the tracker's last reading of the
    /// process's high-water mark; null where nothing was measured.
    pub peak_bytes: Option<u64>,
    /// The most bytes the allocator held reserved at the end of any stage, step or phase (0 on CPU).
    pub peak_reserved_bytes: u64,
    /// Per stage, step and phase.
    pub stages: Vec<StageStats>,
    /// The stage that needs the most on top of what was there.
    pub largest_growth: Option<StageGrowth>,
    /// Sustained growth across steps, when found.
    pub leak: Option<Leak>,
    /// The latest component count.
    pub components: Option<Components>,
    /// Gradient checks that found NaN or Inf.
    pub grad_nonfinite_checks: u64,
    /// OOMs.
    pub ooms: Vec<OomSummary>,
    /// The latest batch plan an integration recorded, or null.
    pub plan: Option<Plan>,
    /// Every plan recorded, in order: one per try where the micro-batch stepped down in-process.
    pub plans: Vec<Plan>,
    /// True when the tracker was closed (the log has an `end` record).
    pub closed: bool,
    /// How the run ended.
    pub ending: Ending,
    /// The attempt of `oomkit run` (or `find-batch`) that wrote the log, where it says.
    pub attempt: Option<u64>,
    /// What the tracker's hooks saw over the whole run, inside steps or not, where the end record says.
    pub seen: Option<Seen>,
    /// True when the steps are the optimizer's steps, which the tracker counted because the code marks none.
    pub steps_from_optimizer: bool,
    /// Why the log has no steps, and what would give it some; null where it has steps.
    pub no_steps: Option<String>,
    /// The attempt the `start` record names: a plan that names none belongs to it.
    #[serde(skip)]
    pub(crate) start_attempt: Option<u64>,
    /// Conclusions, most urgent first.
    pub findings: Vec<Finding>,
    /// Limits of the evidence.
    pub warnings: Vec<Warning>,
}
