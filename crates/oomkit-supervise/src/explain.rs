//! What an out-of-memory message means: its cause, decided from its figures
//! as every source decides it, one sentence with the numbers, and what to
//! change, most effective first. The messages are read in `oom.rs`.

use crate::oom::{expandable_segments_on, find_messages, OomKind, OomMessage};
use oomkit_advice::{Cause, Figures};
use oomkit_units::human_bytes;
use serde::Serialize;
use std::fmt::Write;

/// A message explained: the cause, the numbers behind it, and what to change.
#[derive(Clone, Debug, Serialize)]
pub struct Explanation {
    /// What failed, where, why and the first fix: the lines every report starts with.
    pub verdict: oomkit_advice::Verdict,
    /// The message's numbers.
    #[serde(flatten)]
    pub message: OomMessage,
    /// Why it failed.
    pub cause: Cause,
    /// Memory held by the other processes together.
    pub other_processes_bytes: u64,
    /// Bytes that would have had to be free for the request to succeed.
    pub shortfall_bytes: Option<u64>,
    /// One sentence saying what happened, with the numbers.
    pub summary: String,
    /// What to change, most effective first.
    pub advice: Vec<String>,
    /// How many out-of-memory messages the text held (ranks often repeat one).
    pub messages: usize,
    /// For fragmentation: what would be left on the device once the request
    /// is served from the reserved pieces (free plus reserved-but-unallocated,
    /// less the request); null for other causes or without the figures.
    pub headroom_after_fix_bytes: Option<u64>,
}

/// Below this share of the device left after a fragmentation fix, the
/// device is also nearly full: the fix gets past this request, and the next
/// larger one fails for capacity. 5% of an 80 GiB GPU is 4 GiB, about one
/// large activation or logits tensor of a 7B model at a moderate batch.
pub const THIN_HEADROOM_FRACTION: f64 = 0.05;

/// At or above this share of the allocated memory in private pools, the
/// pools (CUDA graphs, `torch.compile(mode="reduce-overhead")`) are named as
/// where the memory went: each captured shape keeps its own pool, which
/// ordinary allocations cannot use.
pub const PRIVATE_POOL_SHARE: f64 = 0.25;

/// Explains the first out-of-memory message in `text`; `alloc_conf` is the allocator settings in force, if known.
pub fn explain(text: &str, alloc_conf: Option<&str>) -> Option<Explanation> {
    let all = find_messages(text);
    let count = all.len();
    let m = all.into_iter().next()?;
    Some(explain_message(m, count, alloc_conf))
}

fn pct(part: u64, whole: u64) -> String {
    if whole == 0 {
        return String::new();
    }
    format!(" ({:.0}% of it)", 100.0 * part as f64 / whole as f64)
}

/// A figure, or words for one the message does not give.
fn hb(b: Option<u64>) -> String {
    b.map(human_bytes)
        .unwrap_or_else(|| "an unknown amount".into())
}

/// The sentence that says what happened, and the advice for it.
struct Said {
    summary: String,
    advice: Vec<String>,
}

/// The message explained: its figures decide the cause, and the cause the words.
pub(crate) fn explain_message(
    m: OomMessage,
    messages: usize,
    alloc_conf: Option<&str>,
) -> Explanation {
    let others: u64 = m.other_processes.iter().map(|p| p.bytes).sum();
    let req = m.requested_bytes;
    let free = m.free_bytes;
    let unalloc = m.reserved_unallocated_bytes.unwrap_or(0);
    let figures = Figures {
        requested: req,
        capacity: m.capacity_bytes,
        free,
        reserved_unallocated: m.reserved_unallocated_bytes,
        allowed: m.allowed_bytes,
        other_processes: others,
        // Room on the device in a message is not enough to blame a cap:
        // drivers refuse a large piece with more free (pytorch/pytorch#59778);
        // the message says "N allowed" when the process set one.
        free_at_failure: false,
    };
    // Host memory's message has no free figure, so no shortfall is claimed:
    // the host may have had plenty free while a limit of the process's own
    // (`ulimit -v`, `ulimit -d`, a memory cgroup) refused the request.
    let shortfall = figures.shortfall();
    let cause = oomkit_advice::decide(&figures);
    let headroom = match (cause, req) {
        (Cause::Fragmentation, Some(r)) => Some((free.unwrap_or(0) + unalloc).saturating_sub(r)),
        _ => None,
    };
    let device = match m.kind {
        OomKind::Cpu | OomKind::KernelKill => "host memory".to_string(),
        _ => m
            .device
            .map(|d| format!("GPU {d}"))
            .unwrap_or_else(|| "the GPU".into()),
    };
    let Said {
        summary,
        mut advice,
    } = match cause {
        Cause::RequestExceedsCapacity => request_exceeds_capacity(&m, &device),
        Cause::Fragmentation => fragmentation(&m, &device, headroom, alloc_conf),
        Cause::MemoryFractionLimit => fraction_limit(&m, &device),
        Cause::OtherProcesses => other_processes(&m, &device, others),
        Cause::Capacity if m.kind == OomKind::KernelKill => kernel_kill(&m),
        Cause::Capacity if m.kind == OomKind::BatchFinderExhausted => batch_finder_exhausted(),
        Cause::Capacity => capacity(&m, &device, shortfall),
    };
    if let (Some(pools), Some(allocated)) = (m.private_pool_bytes, m.allocated_bytes) {
        if allocated > 0 && pools as f64 >= PRIVATE_POOL_SHARE * allocated as f64 {
            advice.insert(0, format!(
                "{} of the {} allocated is in private pools{}: CUDA graphs (torch.compile mode=\"reduce-overhead\", captured graphs) keep one pool per captured shape, which no other allocation can use; capture fewer shapes (pad to a few fixed sizes), share one pool between graphs, or compile without CUDA graphs.",
                human_bytes(pools),
                human_bytes(allocated),
                pct(pools, allocated)
            ));
        }
    }
    let failure = oomkit_advice::Failure {
        place: oomkit_advice::Place {
            device: match m.kind {
                OomKind::Cpu | OomKind::KernelKill => Some("cpu".into()),
                _ => m.device.map(|d| format!("cuda:{d}")),
            },
            ..Default::default()
        },
        figures,
        live: m.allocated_bytes,
        site: None,
        expandable_segments: alloc_conf.is_some_and(expandable_segments_on),
        // A message does not say what the memory was for.
        largest_role: None,
    };
    // Outside PyTorch's allocator the library that failed decides the first fix.
    let library_fix = match (cause, m.kind) {
        (Cause::Capacity, OomKind::CudaDriver) => Some("run without expandable_segments in PYTORCH_CUDA_ALLOC_CONF, whose driver mapping fails on some platforms (WSL2, Jetson) with memory free; if it still fails, lower the micro-batch"),
        (Cause::Capacity, OomKind::Nccl) => Some("leave NCCL room for its buffers: a smaller micro-batch, torch.cuda.set_per_process_memory_fraction below 1.0, or a lower NCCL_BUFFSIZE"),
        _ => None,
    };
    let verdict = match library_fix {
        Some(fix) => oomkit_advice::Verdict::failed_with_fix(&failure, cause, fix.into()),
        None => oomkit_advice::Verdict::failed(&failure, cause),
    };
    Explanation {
        verdict,
        other_processes_bytes: others,
        shortfall_bytes: shortfall,
        cause,
        summary,
        advice,
        messages,
        message: m,
        headroom_after_fix_bytes: headroom,
    }
}

/// One allocation larger than the whole device: no batch fixes it.
fn request_exceeds_capacity(m: &OomMessage, device: &str) -> Said {
    let mut advice = Vec::new();
    let summary = {
        advice.push(format!(
            "One tensor of {} cannot fit on a {} device at any batch size: find the operation in the traceback and split it (chunk the batch or the sequence), or use a memory-efficient kernel such as flash attention.",
            hb(m.requested_bytes),
            hb(m.capacity_bytes)
        ));
        format!(
            "One allocation asked for {}, more than all of {device} ({}).",
            hb(m.requested_bytes),
            hb(m.capacity_bytes)
        )
    };
    Said { summary, advice }
}

/// Enough reserved but unallocated memory, in pieces too small: the allocator's settings, and room where the device is nearly full too.
fn fragmentation(
    m: &OomMessage,
    device: &str,
    headroom: Option<u64>,
    alloc_conf: Option<&str>,
) -> Said {
    let mut advice = Vec::new();
    let summary = {
        if alloc_conf.is_some_and(expandable_segments_on) {
            advice.push("expandable_segments is already on, so the pieces come from mixed tensor sizes: pad variable-length batches to a few fixed shapes, and avoid keeping long-lived tensors allocated between large temporary ones.".into());
            advice.push("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,garbage_collection_threshold:0.8 to return idle cached blocks earlier.".into());
        } else {
            advice.push("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts: segments then grow in place, and free space inside them can serve large requests.".into());
            advice.push("If that is not possible, set max_split_size_mb (for example PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512) so large blocks are not carved up for small tensors.".into());
        }
        let mut summary = format!(
            "{device} had {} reserved by PyTorch but unallocated, enough for the {} request, but not in one piece: the memory is fragmented.",
            human_bytes(m.reserved_unallocated_bytes.unwrap_or(0)),
            hb(m.requested_bytes)
        );
        if let (Some(left), Some(cap)) = (headroom, m.capacity_bytes) {
            if (left as f64) < THIN_HEADROOM_FRACTION * cap as f64 {
                let _ = write!(
                    summary,
                    " Even with the pieces joined, only {} of {} would be left: the device is nearly full of live tensors, so the next larger allocation will fail for capacity.",
                    human_bytes(left),
                    human_bytes(cap)
                );
                advice.push("Also make room: a smaller micro-batch with more accumulation, or recomputed activations; `oomkit run` tries expandable segments first and steps the batch down if that run fails too.".into());
            }
        }
        summary
    };
    Said { summary, advice }
}

/// The process's own cap, with room on the device.
fn fraction_limit(m: &OomMessage, device: &str) -> Said {
    let mut advice = Vec::new();
    let summary = {
        advice.push(format!(
            "The cap is this process's own: raise or remove torch.cuda.set_per_process_memory_fraction (it allows {}), or cut the micro-batch to fit under it.",
            hb(m.allowed_bytes)
        ));
        format!(
            "The process reached its own memory cap of {} (set_per_process_memory_fraction) while {device} still had {} free for the {} request.",
            hb(m.allowed_bytes),
            hb(m.free_bytes),
            hb(m.requested_bytes)
        )
    };
    Said { summary, advice }
}

/// Other processes held what the request needed: another GPU.
fn other_processes(m: &OomMessage, device: &str, others: u64) -> Said {
    let mut advice = Vec::new();
    let summary = {
        let list: Vec<String> = m
            .other_processes
            .iter()
            .map(|p| format!("pid {} holds {}", p.pid, human_bytes(p.bytes)))
            .collect();
        advice.push(format!(
            "Other processes hold {} on {device} ({}): run on a GPU with more free memory (`oomkit gpus`; `oomkit run` picks one and waits for it), or stop them.",
            human_bytes(others),
            list.join(", ")
        ));
        format!(
            "Other processes held {} of {device}{}; without them the {} request would have fit.",
            human_bytes(others),
            pct(others, m.capacity_bytes.unwrap_or(0)),
            hb(m.requested_bytes)
        )
    };
    Said { summary, advice }
}

/// The kernel's OOM killer ended the process: host memory, with no Python error left.
fn kernel_kill(m: &OomMessage) -> Said {
    let mut advice = Vec::new();
    let summary = {
        advice.push("Host memory ran out and the kernel killed the process, so no Python error was raised: lower the micro-batch (`oomkit run --batch-size B` steps it down after such a kill), and keep host copies small: fewer DataLoader workers and a lower prefetch_factor, data loaded lazily or memory-mapped, checkpoints loaded with torch.load(..., mmap=True).".into());
        advice.push("In a container or a SLURM job the limit is the memory cgroup's, not the machine's: ask for more (`--mem` in SLURM, the pod's memory limit) where the run needs it; `oomkit analyze` on the run's log shows what it held last.".into());
        format!(
            "The kernel's OOM killer ended the process (SIGKILL): host memory ran out{}. A killed process leaves no Python error; its run log's last records are the evidence.",
            m.capacity_bytes
                .map(|c| format!(" at the memory cgroup's limit of {}", human_bytes(c)))
                .unwrap_or_default()
        )
    };
    Said { summary, advice }
}

/// accelerate's batch finder gave up at batch size 1.
fn batch_finder_exhausted() -> Said {
    let mut advice = Vec::new();
    let summary = {
        advice.push("accelerate halves the micro-batch (x0.9 since accelerate 1.9) but leaves gradient accumulation alone, so it cannot keep the effective batch: `oomkit run --batch-size B --effective-batch N -- CMD` retries with a smaller micro-batch and more accumulation, and `oomkit find-batch` finds the largest micro-batch that fits.".into());
        advice.push("Batch size 1 did not fit either: the fixed part (weights, gradients, optimizer state) or one sample's activations is too large; recompute activations (gradient_checkpointing_enable()), shorten the sequence, or shrink optimizer state (8-bit or fused AdamW, FSDP/ZeRO). `oomkit estimate` shows each part.".into());
        "accelerate's find_executable_batch_size (the Trainer's auto_find_batch_size) ran out of memory at every batch size down to 1 and gave up.".to_string()
    };
    Said { summary, advice }
}

/// The process needed more than there was: the micro-batch, activations and optimizer state; or the library that failed.
fn capacity(m: &OomMessage, device: &str, shortfall: Option<u64>) -> Said {
    let mut advice = Vec::new();
    let summary = {
        let cut = shortfall.unwrap_or(0);
        // Who failed, where it is not PyTorch's allocator.
        let library = match m.kind {
            OomKind::Cublas => Some("cuBLAS could not allocate its handle or workspace"),
            OomKind::Cudnn => Some("cuDNN could not allocate its workspace"),
            OomKind::Nccl => Some("NCCL could not allocate its buffers"),
            OomKind::CudaDriver => Some(
                "The CUDA driver could not map memory for the caching allocator's expandable segments",
            ),
            OomKind::CudaRuntime => Some(
                "A CUDA call outside PyTorch's caching allocator (a kernel's launch, a library, the context) could not get memory",
            ),
            _ => None,
        };
        if m.kind == OomKind::CudaDriver {
            advice.push("This is the driver API that PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True maps memory with (cuMemCreate, cuMemMap): under WSL2 and on Jetson boards it fails with memory still free (unslothai/unsloth#2401), so first try the run without expandable_segments; if the device really was full, the advice below applies.".into());
        }
        if m.kind == OomKind::Nccl {
            advice.push("NCCL allocates its buffers outside PyTorch's allocator, when a communicator first runs a collective, so PyTorch's cache may already hold the memory they need: leave headroom (a smaller micro-batch, or torch.cuda.set_per_process_memory_fraction below 1.0 so the cache stops short), lower NCCL_BUFFSIZE, or on NVLink-switch machines (H100, H200) set NCCL_NVLS_ENABLE=0, whose buffers are the largest.".into());
        }
        if m.kind == OomKind::Mps {
            advice.push("MPS stops at its high watermark (\"max allowed\"), a share of the machine's unified memory: cut the micro-batch, or raise PYTORCH_MPS_HIGH_WATERMARK_RATIO (0.0 removes the cap, at the risk of the whole machine swapping).".into());
        }
        if m.kind == OomKind::Cpu {
            advice.push("Host memory ran out: lower DataLoader num_workers and prefetch_factor, load data lazily or memory-mapped, and keep checkpoints off the host while loading.".into());
        } else {
            let held = m.process_bytes.or(m.allocated_bytes);
            let of_held = held.map(|h| pct(cut, h)).unwrap_or_default();
            if cut > 0 {
                advice.push(format!(
                    "Cut at least {}{of_held} of this process's memory; activations usually shrink in proportion to the micro-batch.",
                    human_bytes(cut)
                ));
            }
            advice.push("Halve the micro-batch and double gradient accumulation to keep the effective batch: `oomkit run --batch-size B -- CMD ... {batch_size} {grad_accum}` does it on each OOM, and `oomkit find-batch` finds the largest batch that fits.".into());
            advice.push("Recompute activations (torch.utils.checkpoint, or gradient_checkpointing_enable() in Hugging Face models), train in bf16 autocast, and use flash attention (scaled_dot_product_attention).".into());
            advice.push("Shrink optimizer state: a fused or 8-bit AdamW, or shard it across GPUs with FSDP or ZeRO; `oomkit estimate` shows how much each choice saves.".into());
        }
        match (m.requested_bytes, m.free_bytes) {
            (Some(r), None) if m.kind == OomKind::Cpu => format!(
                "The host allocator could not get {} of host memory: the machine's memory, or a limit of the process's own (`ulimit -v` or `-d`, a memory cgroup), refused it; the message does not say how much was free.",
                human_bytes(r)
            ),
            (Some(r), Some(f)) if f >= r && !matches!(m.kind, OomKind::Cpu | OomKind::Mps) => format!(
                "The driver reported {} free, more than the {} request, yet the allocation failed: the free memory was not in one piece, or cuBLAS/cuDNN workspaces or another process took it first.",
                human_bytes(f),
                human_bytes(r)
            ),
            (None, None) => format!(
                "{}: {device} was full. The message gives no figures; `oomkit analyze` on a snapshot or run log of the run shows what held the memory.",
                library.unwrap_or("An allocation failed")
            ),
            _ => {
                let request = format!(
                    "the request{} found {} free{}.",
                    m.requested_bytes.map(|r| format!(" for {}", human_bytes(r)))
                        .unwrap_or_default(),
                    m.free_bytes.map(human_bytes)
                        .unwrap_or_else(|| "too little".into()),
                    m.process_bytes
                        .map(|p| format!(", and this process held {}", human_bytes(p)))
                        .unwrap_or_default()
                );
                match library {
                    Some(who) => format!("{who} on {device}: {request}"),
                    None => format!("{device} was full: {request}"),
                }
            }
        }
    };
    Said { summary, advice }
}
