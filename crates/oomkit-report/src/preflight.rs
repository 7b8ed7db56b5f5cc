//! What `oomkit preflight` measured: the answer the Python side writes for
//! one run of the user's script on meta tensors, and the search over
//! micro-batches made of several such runs.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One preflight run, as `oomkit.preflight.Preflight.as_dict()` writes it.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct PreflightRun {
    /// The micro-batch substituted for `{batch}`, or null where the script sets its own.
    pub micro_batch: Option<u64>,
    /// Micro-batches accumulated per optimizer step, where known (the Python API's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_accum: Option<u64>,
    /// Optimizer steps the script ran.
    pub steps: u64,
    /// The most memory handed out at once, in the allocator's rounded blocks.
    pub peak_allocated_bytes: u64,
    /// The most memory the modelled allocator reserved.
    pub peak_reserved_bytes: u64,
    /// Reserved but not handed out when reserved peaked.
    pub free_in_segments_at_peak_bytes: u64,
    /// What the allocator may hold.
    pub capacity_bytes: u64,
    /// The capacity as given.
    pub capacity: String,
    /// No allocation failed with the allocator limited to the capacity.
    pub fits: bool,
    /// The capacity less the peak reserved.
    pub margin_bytes: i64,
    /// Bytes live at the allocated peak by role.
    pub by_role: BTreeMap<String, u64>,
    /// The user's lines holding the most at the allocated peak.
    pub by_line: Vec<LineBytes>,
    /// Allocations recorded.
    pub allocations: u64,
    /// What the preflight assumed or could not do.
    pub notes: Vec<String>,
    /// The snapshot written, if any.
    pub snapshot: Option<String>,
    /// `training` (optimizer steps or backward passes) or `inference` (forwards alone, the whole run measured).
    #[serde(default = "training")]
    pub mode: String,
    /// Top-level forwards of the model run.
    #[serde(default)]
    pub forwards: u64,
    /// The most allocated while each phase ran (`eval`: forwards without gradients in a script that trains).
    #[serde(default)]
    pub phase_peaks: BTreeMap<String, u64>,
    /// The most allocated during each optimizer step, set-up left out of the first.
    #[serde(default)]
    pub step_peaks: Vec<u64>,
    /// The most host memory the script held for the GPU at once (pinned buffers, copies of
    /// GPU tensors), outside the GPU's figures.
    #[serde(default)]
    pub host_peak_bytes: u64,
    /// Of it, the most that was pinned at once.
    #[serde(default)]
    pub host_pinned_peak_bytes: u64,
    /// The most unified (paged) memory held at once (bitsandbytes' paged optimizer state),
    /// outside PyTorch's allocator: in neither the GPU's figures nor `host_peak_bytes`.
    #[serde(default)]
    pub host_paged_peak_bytes: u64,
    /// Where the GPU ran out as the script ran (`oomkit preflight`'s first run raises CUDA's
    /// out-of-memory error in the script where the allocator model refuses an allocation);
    /// None where it never did.
    #[serde(default)]
    pub out_of_memory: Option<OutOfMemory>,
    /// The same recorded step replayed by the allocator model under other
    /// settings (`oomkit preflight`'s expandable-segments fix), where asked:
    /// read by the command, not part of the run's answer.
    #[serde(default, skip_serializing)]
    pub replayed: Option<Replayed>,
    /// The changes a run of several skipped because they cannot be made here
    /// (`oomkit preflight`'s "all of the above", run beside the changes alone):
    /// read by the command, not part of the run's answer.
    #[serde(default, skip_serializing)]
    pub fixes_skipped: Vec<String>,
    /// The changes the script already makes, run as written, each with why it would change
    /// nothing (by the name of the change inside the script): read by the command, which
    /// makes them rows saying so, not part of the run's answer.
    #[serde(default, skip_serializing)]
    pub in_script: BTreeMap<String, String>,
    /// The framework recipe the script ran (a torchtune recipe), with the memory switches its
    /// config sets: read by the command, whose changes are then the recipe's own switches.
    #[serde(default, skip_serializing)]
    pub recipe: Option<Recipe>,
}

/// Where the GPU of the capacity ran out as the script ran, and what the script did then.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct OutOfMemory {
    /// CUDA out-of-memory errors raised in the script.
    pub raised: u64,
    /// The bytes the first tried to allocate (the segment it needed).
    pub first_bytes: u64,
    /// The script's line where the first was raised.
    pub first_at: String,
    /// Whether the script completed a step after the last (caught them and went on, at a
    /// smaller batch or past a skipped one): the figures are of what it ran after. Else
    /// the figures are of the script run again with nothing refused.
    pub went_on: bool,
    /// How the script ended after the last, where it did not go on and ended other than
    /// by that error (another error, or catching error after error without a step).
    #[serde(default)]
    pub ended: Option<String>,
}

/// A framework's recipe as its run read it: which, and the settings its config gave.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Recipe {
    /// The framework (`torchtune`).
    pub framework: String,
    /// The recipe, as it names itself (`FullFinetuneRecipeSingleDevice`).
    pub name: String,
    /// Its settings by their dotted names in the config (null where the config has none).
    #[serde(default)]
    pub settings: BTreeMap<String, serde_json::Value>,
}

/// A recorded step replayed by the allocator model under other settings.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Replayed {
    /// The settings it was replayed with, as PYTORCH_CUDA_ALLOC_CONF writes them.
    pub alloc_conf: String,
    /// The most memory handed out at once.
    pub peak_allocated_bytes: u64,
    /// The most memory the modelled allocator reserved.
    pub peak_reserved_bytes: u64,
    /// No allocation failed with the allocator limited to the capacity.
    pub fits: bool,
}

/// The mode of an answer that does not say (one written before inference was measured).
fn training() -> String {
    "training".into()
}

/// A change that might make a step fit, measured on the script.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FixRow {
    /// The change, in words.
    pub change: String,
    /// The peak allocated with it.
    pub peak_allocated_bytes: u64,
    /// The peak reserved with it.
    pub peak_reserved_bytes: u64,
    /// Whether it fits the capacity with it.
    pub fits: bool,
    /// What it costs, in words.
    pub cost: String,
    /// The changes its run skipped as not possible here (a run of several), for the command.
    #[serde(skip)]
    pub skipped: Vec<String>,
    /// Why the change would change nothing, where the script already makes it: its peaks
    /// are then the script's as written, not a run of the change (null where measured).
    #[serde(default)]
    pub already: Option<String>,
}

/// A line of the user's code and what it held at the peak.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct LineBytes {
    /// `file:line (function)`.
    pub line: String,
    /// The role of what it held.
    pub role: String,
    /// The bytes.
    pub bytes: u64,
}

/// What `oomkit preflight` prints: the run at the first micro-batch and, with a search, the rest.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PreflightReport {
    /// The command as given (with `{batch}` where the search substitutes it).
    pub command: Vec<String>,
    /// The run at the first micro-batch (or the script's own).
    pub run: PreflightRun,
    /// The values the search tried, by size, and whether each fitted.
    pub tried: Vec<(u64, bool)>,
    /// The largest micro-batch that fits, when the micro-batch was searched.
    pub largest_micro_batch: Option<u64>,
    /// The placeholder searched (`batch` for `--max-micro-batch`, the name
    /// `--search NAME=LO..HI` gave), where a search ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub searched: Option<String>,
    /// The largest value of it that fits (null: not even the smallest tried), where a search ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub largest: Option<Option<u64>>,
    /// What would make it fit: each change run on the script, then all of
    /// them (when it does not fit, or with `--fixes`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fixes: Vec<FixRow>,
    /// The changes that could not be measured, and why.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fix_notes: Vec<String>,
    /// The accumulation that keeps the effective batch at it, where the accumulation is known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub largest_grad_accum: Option<u64>,
}
