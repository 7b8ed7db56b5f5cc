//! PyTorch's out-of-memory messages: found in a child's output, read into
//! numbers, and explained.
//!
//! The forms come from `c10/cuda/CUDACachingAllocator.cpp` across releases:
//! the current one ("GPU 0 has a total capacity of ... of which ... is free"),
//! the 2.1 misspelling "capacty", the pre-2.1 parenthesised one ("(GPU 0;
//! 7.93 GiB total capacity; ... already allocated; ... free; ... reserved in
//! total by PyTorch)"), the 1.0-1.3 variant whose last figure is "cached"
//! (memory held but not allocated, pytorch/pytorch#13751), ROCm's "HIP out of
//! memory", Intel's "XPU out of memory" (with and without the free clause),
//! Ascend's `torch_npu` "NPU out of memory" (the parenthesised form with "NPU
//! 0;"), Apple's "MPS backend out of memory (MPS allocated: ..., other
//! allocations: ..., max allowed: ...)", the THC-era `THCudaCheck FAIL ...
//! error=2 : out of memory` and `cuda runtime error (2) : out of memory`, and
//! the allocator failures that surface from cuBLAS, cuDNN and the CPU.
//! Messages pasted with hard line breaks, or quoted from "Tried to allocate"
//! on, are read too.

use oomkit_advice::Figures;
use oomkit_units::human_bytes;
use regex::Regex;
use serde::Serialize;
use std::sync::OnceLock;

/// Which allocator or library ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OomKind {
    /// PyTorch's CUDA caching allocator.
    Cuda,
    /// PyTorch's allocator on ROCm.
    Hip,
    /// PyTorch's allocator on Intel GPUs.
    Xpu,
    /// Apple's Metal backend.
    Mps,
    /// Huawei Ascend NPUs, through `torch_npu`.
    Npu,
    /// A CUDA runtime call outside the caching allocator (a kernel's
    /// launch, context creation, a library's own `cudaMalloc`).
    CudaRuntime,
    /// The CUDA driver API, which the caching allocator's expandable
    /// segments map memory with (`cuMemCreate`, `cuMemMap`).
    CudaDriver,
    /// NCCL could not allocate its communication buffers.
    Nccl,
    /// cuBLAS could not allocate its workspace.
    Cublas,
    /// cuDNN failed in a way that is usually memory.
    Cudnn,
    /// Host memory, through PyTorch's CPU allocator.
    Cpu,
    /// The kernel's OOM killer ended the process (SIGKILL): host memory, past
    /// a memory cgroup's limit or the machine's; no Python error is left.
    KernelKill,
    /// accelerate's `find_executable_batch_size` (behind the Hugging Face
    /// Trainer's `auto_find_batch_size`) ran out at every batch size it tried.
    BatchFinderExhausted,
    /// `OutOfMemoryError` with no further detail.
    Unspecified,
}

/// How `oomkit run` starts the line that says the kernel's OOM killer ended an attempt.
pub const KERNEL_KILL_MARKER: &str = "killed by the kernel's OOM killer";

/// Markers in the order they are tried: the specific before the generic.
const MARKERS: &[(&str, OomKind)] = &[
    (KERNEL_KILL_MARKER, OomKind::KernelKill),
    // The kernel's own log (`dmesg`, `journalctl -k`) as users paste it.
    (
        "Memory cgroup out of memory: Killed process",
        OomKind::KernelKill,
    ),
    ("Out of memory: Killed process", OomKind::KernelKill),
    ("CUDA out of memory", OomKind::Cuda),
    ("HIP out of memory", OomKind::Hip),
    ("XPU out of memory", OomKind::Xpu),
    ("MPS backend out of memory", OomKind::Mps),
    ("NPU out of memory", OomKind::Npu),
    ("CUDA error: out of memory", OomKind::CudaRuntime),
    // The driver API, as expandable segments map memory with it.
    ("CUDA driver error: out of memory", OomKind::CudaDriver),
    // NCCL's own check of a CUDA call, on the line after "Last error:".
    ("Cuda failure 'out of memory'", OomKind::Nccl),
    ("Cuda failure 2 'out of memory'", OomKind::Nccl),
    // PyTorch before 1.0 (THC): `THCudaCheck FAIL file=... line=... error=2 : out of memory`.
    ("error=2 : out of memory", OomKind::CudaRuntime),
    (
        "cuda runtime error (2) : out of memory",
        OomKind::CudaRuntime,
    ),
    ("CUBLAS_STATUS_ALLOC_FAILED", OomKind::Cublas),
    ("CUDNN_STATUS_ALLOC_FAILED", OomKind::Cudnn),
    ("CUDNN_STATUS_NOT_SUPPORTED", OomKind::Cudnn),
    ("DefaultCPUAllocator: can't allocate memory", OomKind::Cpu),
    ("DefaultCPUAllocator: not enough memory", OomKind::Cpu),
    // accelerate raises this outside its `except`, so no chained OOM follows it.
    (
        "No executable batch size found",
        OomKind::BatchFinderExhausted,
    ),
    ("OutOfMemoryError", OomKind::Unspecified),
];

/// The kind of out-of-memory failure that `line` reports, if any.
pub fn detect(line: &str) -> Option<OomKind> {
    MARKERS
        .iter()
        .find(|(m, _)| line.contains(m))
        .map(|(_, k)| *k)
}

/// Another process holding memory on the GPU, as the message names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OtherProcess {
    /// Its process id (the host's, inside containers).
    pub pid: u32,
    /// GPU memory it holds.
    pub bytes: u64,
}

/// The numbers in one out-of-memory message; `None` where the message's form lacks one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OomMessage {
    /// Which allocator or library ran out.
    pub kind: OomKind,
    /// The GPU index as the failing process numbered it (after `CUDA_VISIBLE_DEVICES`).
    pub device: Option<u32>,
    /// Bytes the failed allocation asked for.
    pub requested_bytes: Option<u64>,
    /// Memory on the device, as the driver reports it.
    pub capacity_bytes: Option<u64>,
    /// Memory the driver reported free.
    pub free_bytes: Option<u64>,
    /// Memory this process held, including the CUDA context and other non-PyTorch use.
    pub process_bytes: Option<u64>,
    /// Memory held by live tensors.
    pub allocated_bytes: Option<u64>,
    /// Memory PyTorch had reserved from the driver but not handed to tensors.
    pub reserved_unallocated_bytes: Option<u64>,
    /// Memory in private pools such as CUDA graphs, part of the allocated memory.
    pub private_pool_bytes: Option<u64>,
    /// The process's own cap from `torch.cuda.set_per_process_memory_fraction` ("N allowed;").
    pub allowed_bytes: Option<u64>,
    /// Other processes on the GPU, where the message lists them.
    pub other_processes: Vec<OtherProcess>,
    /// The message itself, as one line.
    pub text: String,
}

pub use oomkit_advice::Cause;

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

fn size_pattern() -> &'static str {
    // MPS printed KB/MB/GB before it printed KiB/MiB/GiB, with the same 1024 steps.
    r"([0-9]+(?:\.[0-9]+)?) ?(bytes|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b"
}

struct Patterns {
    requested: Regex,
    total_new: Regex,
    process: Regex,
    this_process: Regex,
    allocated_new: Regex,
    private_pools: Regex,
    allowed: Regex,
    unallocated_new: Regex,
    gpu_old: Regex,
    total_old: Regex,
    allocated_old: Regex,
    free_old: Regex,
    reserved_old: Regex,
    cached_old: Regex,
    mps: Regex,
    cpu_bytes: Regex,
    kill_limit: Regex,
    nccl_bytes: Regex,
    nccl_device: Regex,
}

fn patterns() -> &'static Patterns {
    static P: OnceLock<Patterns> = OnceLock::new();
    P.get_or_init(|| {
        let s = size_pattern();
        let re = |p: String| Regex::new(&p).unwrap_or_else(|e| panic!("bad pattern {p}: {e}"));
        Patterns {
            requested: re(format!(r"(?i)tried to allocate {s}")),
            total_new: re(format!(
                r"GPU (\d+) has a total capac(?:i)?ty of {s}(?: of which {s} is free)?"
            )),
            process: re(format!(r"Process (\d+) has {s} memory in use")),
            this_process: re(format!(r"this process has {s} memory in use")),
            allocated_new: re(format!(
                r"Of the allocated memory {s} is allocated by PyTorch"
            )),
            private_pools: re(format!(r"with {s} allocated in private pools")),
            allowed: re(format!(r"{s} allowed;")),
            unallocated_new: re(format!(r"{s} is reserved by PyTorch but unallocated")),
            gpu_old: re(r"\((?:GPU|NPU) ?(\d+);".into()),
            total_old: re(format!(r"{s} total capacity")),
            allocated_old: re(format!(r"{s} already allocated")),
            free_old: re(format!(r"{s} free[;)]")),
            reserved_old: re(format!(r"{s} reserved in total by PyTorch")),
            cached_old: re(format!(r"{s} cached\)")),
            mps: re(format!(
                r"MPS allocated: {s}, other allocations: {s}, max allowed: {s}"
            )),
            cpu_bytes: re(r"you tried to allocate (\d+) bytes".into()),
            kill_limit: re(r"\(limit of (\d+) bytes\)".into()),
            // NCCL's next warning names the size: "Failed to CUDA calloc 6291456 bytes".
            nccl_bytes: re(r"Failed to CUDA [cm]alloc (\d+) bytes".into()),
            // NCCL's prefix: "host:pid:tid [local device] file:line NCCL WARN".
            nccl_device: re(r"\[(\d+)\] \S+ NCCL WARN".into()),
        }
    })
}

fn size_at(caps: &regex::Captures<'_>, first: usize) -> Option<u64> {
    let value: f64 = caps.get(first)?.as_str().parse().ok()?;
    let scale = match caps.get(first + 1)?.as_str() {
        "bytes" | "B" => 1.0,
        "KiB" | "KB" => 1024.0,
        "MiB" | "MB" => 1024.0 * 1024.0,
        "GiB" | "GB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" | "TB" => 1024f64.powi(4),
        _ => return None,
    };
    Some((value * scale).round() as u64)
}

fn find_size(re: &Regex, text: &str) -> Option<u64> {
    re.captures(text).and_then(|c| size_at(&c, 1))
}

/// Reads the numbers from one message (the marker's line and any continuation lines joined).
pub fn parse_message(kind: OomKind, text: &str) -> OomMessage {
    let p = patterns();
    let mut m = OomMessage {
        kind,
        device: None,
        requested_bytes: find_size(&p.requested, text),
        capacity_bytes: None,
        free_bytes: None,
        process_bytes: find_size(&p.this_process, text),
        allocated_bytes: None,
        reserved_unallocated_bytes: None,
        private_pool_bytes: find_size(&p.private_pools, text),
        allowed_bytes: find_size(&p.allowed, text),
        other_processes: Vec::new(),
        text: text.trim().to_string(),
    };
    if let Some(c) = p.total_new.captures(text) {
        m.device = c.get(1).and_then(|d| d.as_str().parse().ok());
        m.capacity_bytes = size_at(&c, 2);
        m.free_bytes = size_at(&c, 4);
        m.allocated_bytes = find_size(&p.allocated_new, text);
        m.reserved_unallocated_bytes = find_size(&p.unallocated_new, text);
        m.other_processes = p
            .process
            .captures_iter(text)
            .filter_map(|c| {
                Some(OtherProcess {
                    pid: c.get(1)?.as_str().parse().ok()?,
                    bytes: size_at(&c, 2)?,
                })
            })
            .collect();
    } else if let Some(total) = find_size(&p.total_old, text) {
        m.device = p
            .gpu_old
            .captures(text)
            .and_then(|c| c.get(1)?.as_str().parse().ok());
        m.capacity_bytes = Some(total);
        m.allocated_bytes = find_size(&p.allocated_old, text);
        m.free_bytes = find_size(&p.free_old, text);
        let reserved = find_size(&p.reserved_old, text);
        m.reserved_unallocated_bytes = match (reserved, m.allocated_bytes) {
            (Some(r), Some(a)) => Some(r.saturating_sub(a)),
            // 1.0-1.3 printed what the allocator held beyond the allocated memory as "cached".
            _ => find_size(&p.cached_old, text),
        };
    } else if let Some(c) = p.mps.captures(text) {
        // MPS has no device total: its high watermark ("max allowed", 1.7x the
        // GPU's recommended working set by default) is the capacity it enforces,
        // and "other allocations" are this process's Metal memory outside the allocator.
        let (allocated, other, cap) = (size_at(&c, 1), size_at(&c, 3), size_at(&c, 5));
        m.allocated_bytes = allocated;
        m.process_bytes = allocated.zip(other).map(|(a, o)| a + o);
        m.capacity_bytes = cap;
        m.free_bytes = cap
            .zip(m.process_bytes)
            .map(|(cap, held)| cap.saturating_sub(held));
    }
    if kind == OomKind::Nccl {
        m.requested_bytes = p
            .nccl_bytes
            .captures(text)
            .and_then(|c| c.get(1)?.as_str().parse().ok());
        m.device = p
            .nccl_device
            .captures(text)
            .and_then(|c| c.get(1)?.as_str().parse().ok());
    }
    if kind == OomKind::KernelKill {
        m.capacity_bytes = p
            .kill_limit
            .captures(text)
            .and_then(|c| c.get(1)?.as_str().parse().ok());
    }
    if kind == OomKind::Cpu && m.requested_bytes.is_none() {
        m.requested_bytes = p
            .cpu_bytes
            .captures(text)
            .and_then(|c| c.get(1)?.as_str().parse().ok());
    }
    // Inside a container the message lists this process by its host pid and
    // omits "this process has": the entry that covers PyTorch's own memory is ours.
    if m.process_bytes.is_none() && !m.other_processes.is_empty() {
        let ours = m.allocated_bytes.unwrap_or(0) + m.reserved_unallocated_bytes.unwrap_or(0);
        let mine = m
            .other_processes
            .iter()
            .enumerate()
            .filter(|(_, p)| p.bytes >= ours)
            .min_by_key(|(_, p)| p.bytes - ours)
            .map(|(i, _)| i);
        if let Some(i) = mine {
            m.process_bytes = Some(m.other_processes.remove(i).bytes);
        }
    }
    m
}

/// Lines after a marker's line that can still belong to its message: a
/// current CUDA message hard-wrapped at 72 columns, as pasted in issues, takes six.
const CONTINUATION_LINES: usize = 8;

/// Whether a line starts a message quoted from "Tried to allocate" on, with no marker before it.
fn quoted_from_request(line: &str) -> bool {
    line.trim_start()
        .trim_start_matches(['`', '"', '\'', '>', ' '])
        .starts_with("Tried to allocate")
}

/// Whether a marker starts on line `i` and runs on over the next lines, as
/// "CUDA" / "out of" / "memory" does when a narrow terminal wraps it.
fn marker_wrapped_from(lines: &[&str], i: usize) -> bool {
    let first = lines[i].trim();
    if first.is_empty() {
        return false;
    }
    let mut joined = first.to_string();
    for next in lines.iter().skip(i + 1).take(MARKER_WORDS) {
        if next.trim().is_empty() {
            break;
        }
        joined.push(' ');
        joined.push_str(next.trim());
    }
    MARKERS.iter().any(|(m, _)| {
        joined
            .match_indices(m)
            .any(|(at, _)| at < first.len() && at + m.len() > first.len())
    })
}

/// Lines after NCCL's out-of-memory warning where its size warning may follow.
const NCCL_SIZE_LINES: usize = 4;

/// The most lines a wrapped marker can span: the longest has four words.
const MARKER_WORDS: usize = 4;

/// Every out-of-memory message in `text` (a message, or a whole log with tracebacks), in order.
///
/// A message runs from its marker's line over the lines that continue it (up
/// to [`CONTINUATION_LINES`], stopping at a blank line, a traceback line or
/// another marker), joined with single spaces, so a hard-wrapped message
/// reads as one; its kind is decided on the joined text, so a marker broken
/// across lines, or a bare "OutOfMemoryError" line followed by the real
/// message, gets the specific kind.
pub fn find_messages(text: &str) -> Vec<OomMessage> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let quoted = detect(lines[i]).is_none() && quoted_from_request(lines[i]);
        let split_marker = marker_wrapped_from(&lines, i);
        if detect(lines[i]).is_none() && !quoted && !split_marker {
            i += 1;
            continue;
        }
        let mut joined = lines[i].trim().to_string();
        let mut j = i + 1;
        while j < lines.len()
            && j <= i + CONTINUATION_LINES
            && !lines[j].trim().is_empty()
            // A bare "OutOfMemoryError" line is continued by the real message.
            && (detect(lines[j]).is_none() || detect(&joined) == Some(OomKind::Unspecified))
            // "Tried to allocate" continues a marker's line, unless this
            // message already has its own: then it starts the next one.
            && !(quoted_from_request(lines[j]) && joined.contains("Tried to allocate"))
        {
            if lines[j].starts_with("  File ") || lines[j].starts_with("Traceback") {
                break;
            }
            joined.push(' ');
            joined.push_str(lines[j].trim());
            j += 1;
        }
        // NCCL names the size it failed to get in its next warning, after a blank line.
        if detect(&joined) == Some(OomKind::Nccl) {
            if let Some(next) = lines
                .iter()
                .skip(j)
                .take(NCCL_SIZE_LINES)
                .find(|l| patterns().nccl_bytes.is_match(l))
            {
                joined.push(' ');
                joined.push_str(next.trim());
            }
        }
        let joined = joined.split_whitespace().collect::<Vec<_>>().join(" ");
        // Quoted from "Tried to allocate" on, it is the caching allocator's own
        // sentence: Ascend's when it names an NPU, CUDA's otherwise.
        let kind = detect(&joined).or_else(|| {
            quoted.then_some(if joined.contains("(NPU") {
                OomKind::Npu
            } else {
                OomKind::Cuda
            })
        });
        if let Some(kind) = kind {
            let m = parse_message(kind, &joined);
            // A "Tried to allocate" line with no figures is not a message on its own.
            if !quoted || m.capacity_bytes.is_some() || m.free_bytes.is_some() {
                out.push(m);
            }
        }
        i = j;
    }
    // An exception's repr, its str and a rank prefix often repeat one failure.
    out.dedup_by(|a, b| {
        a.requested_bytes == b.requested_bytes && a.free_bytes == b.free_bytes && a.kind == b.kind
    });
    out
}

/// Whether `PYTORCH_CUDA_ALLOC_CONF`-style settings turn expandable segments on.
pub fn expandable_segments_on(settings: &str) -> bool {
    settings.split(',').any(|kv| {
        kv.trim()
            .replace(' ', "")
            .eq_ignore_ascii_case("expandable_segments:true")
    })
}

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

fn explain_message(m: OomMessage, messages: usize, alloc_conf: Option<&str>) -> Explanation {
    use std::fmt::Write;
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
    let hb = |b: Option<u64>| {
        b.map(human_bytes)
            .unwrap_or_else(|| "an unknown amount".into())
    };
    let mut advice = Vec::new();
    let summary = match cause {
        Cause::RequestExceedsCapacity => {
            advice.push(format!(
                "One tensor of {} cannot fit on a {} device at any batch size: find the operation in the traceback and split it (chunk the batch or the sequence), or use a memory-efficient kernel such as flash attention.",
                hb(req),
                hb(m.capacity_bytes)
            ));
            format!(
                "One allocation asked for {}, more than all of {device} ({}).",
                hb(req),
                hb(m.capacity_bytes)
            )
        }
        Cause::Fragmentation => {
            if alloc_conf.is_some_and(expandable_segments_on) {
                advice.push("expandable_segments is already on, so the pieces come from mixed tensor sizes: pad variable-length batches to a few fixed shapes, and avoid keeping long-lived tensors allocated between large temporary ones.".into());
                advice.push("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,garbage_collection_threshold:0.8 to return idle cached blocks earlier.".into());
            } else {
                advice.push("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts: segments then grow in place, and free space inside them can serve large requests.".into());
                advice.push("If that is not possible, set max_split_size_mb (for example PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512) so large blocks are not carved up for small tensors.".into());
            }
            let mut summary = format!(
                "{device} had {} reserved by PyTorch but unallocated, enough for the {} request, but not in one piece: the memory is fragmented.",
                human_bytes(unalloc),
                hb(req)
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
        }
        Cause::MemoryFractionLimit => {
            advice.push(format!(
                "The cap is this process's own: raise or remove torch.cuda.set_per_process_memory_fraction (it allows {}), or cut the micro-batch to fit under it.",
                hb(m.allowed_bytes)
            ));
            format!(
                "The process reached its own memory cap of {} (set_per_process_memory_fraction) while {device} still had {} free for the {} request.",
                hb(m.allowed_bytes),
                hb(free),
                hb(req)
            )
        }
        Cause::OtherProcesses => {
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
                hb(req)
            )
        }
        Cause::Capacity if m.kind == OomKind::KernelKill => {
            advice.push("Host memory ran out and the kernel killed the process, so no Python error was raised: lower the micro-batch (`oomkit run --batch-size B` steps it down after such a kill), and keep host copies small: fewer DataLoader workers and a lower prefetch_factor, data loaded lazily or memory-mapped, checkpoints loaded with torch.load(..., mmap=True).".into());
            advice.push("In a container or a SLURM job the limit is the memory cgroup's, not the machine's: ask for more (`--mem` in SLURM, the pod's memory limit) where the run needs it; `oomkit analyze` on the run's log shows what it held last.".into());
            format!(
                "The kernel's OOM killer ended the process (SIGKILL): host memory ran out{}. A killed process leaves no Python error; its run log's last records are the evidence.",
                m.capacity_bytes
                    .map(|c| format!(" at the memory cgroup's limit of {}", human_bytes(c)))
                    .unwrap_or_default()
            )
        }
        Cause::Capacity if m.kind == OomKind::BatchFinderExhausted => {
            advice.push("accelerate halves the micro-batch (x0.9 since accelerate 1.9) but leaves gradient accumulation alone, so it cannot keep the effective batch: `oomkit run --batch-size B --effective-batch N -- CMD` retries with a smaller micro-batch and more accumulation, and `oomkit find-batch` finds the largest micro-batch that fits.".into());
            advice.push("Batch size 1 did not fit either: the fixed part (weights, gradients, optimizer state) or one sample's activations is too large; recompute activations (gradient_checkpointing_enable()), shorten the sequence, or shrink optimizer state (8-bit or fused AdamW, FSDP/ZeRO). `oomkit estimate` shows each part.".into());
            "accelerate's find_executable_batch_size (the Trainer's auto_find_batch_size) ran out of memory at every batch size down to 1 and gave up.".to_string()
        }
        Cause::Capacity => {
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
            match (req, free) {
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
                        req.map(|r| format!(" for {}", human_bytes(r)))
                            .unwrap_or_default(),
                        free.map(human_bytes)
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
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_every_form() {
        assert_eq!(
            detect("torch.OutOfMemoryError: CUDA out of memory. Tried"),
            Some(OomKind::Cuda)
        );
        assert_eq!(
            detect("RuntimeError: CUDA error: out of memory"),
            Some(OomKind::CudaRuntime)
        );
        assert_eq!(
            detect("HIP out of memory. Tried to allocate"),
            Some(OomKind::Hip)
        );
        assert_eq!(
            detect("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
            Some(OomKind::Cublas)
        );
        assert_eq!(
            detect("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if"),
            Some(OomKind::Cudnn)
        );
        assert_eq!(detect("step 10 loss 2.1"), None);
        assert_eq!(detect("torch.OutOfMemoryError"), Some(OomKind::Unspecified));
        assert_eq!(
            detect("RuntimeError: No executable batch size found, reached zero."),
            Some(OomKind::BatchFinderExhausted)
        );
    }

    #[test]
    fn expandable_segments_setting() {
        assert!(expandable_segments_on("expandable_segments:True"));
        assert!(expandable_segments_on(
            "max_split_size_mb:128, expandable_segments:true"
        ));
        assert!(!expandable_segments_on("expandable_segments:False"));
        assert!(!expandable_segments_on(""));
    }
}
