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
