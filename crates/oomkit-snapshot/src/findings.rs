//! The rules that turn a snapshot's device reports into findings: one
//! function per rule, each with its thresholds named and the numbers it
//! rests on carried into the finding's message and bytes.

use crate::report::{DeviceReport, OomReport, PhaseReport};
use oomkit_advice::Optimizer;
use oomkit_advice::{Cause, Finding, FindingKind, Role, RoleBytes};
use oomkit_units::human_bytes;

/// Most OOM entries of a trace that get their holders of memory and a
/// finding; the rest are listed with their own figures only.
pub(crate) const OOMS_DETAILED: usize = 32;
/// One site holding this share of the peak is where to start: 40% is more
/// than any other single line can hold at the same time.
const DOMINANT_SHARE: f64 = 0.4;
/// A phase that keeps this many bytes alive past its end is reported...
const RETAINED_MIN_BYTES: u64 = 256 << 20;
/// ... when that is also this share of the peak: less is the noise of caches and small buffers.
const RETAINED_MIN_SHARE: f64 = 0.05;
/// Free memory inside segments is reported as fragmentation only from this
/// share of the reserved memory: below it, the cache's rounding and the
/// blocks kept for reuse are ordinary allocator behaviour.
const FRAGMENTED_MIN_FRACTION: f64 = 0.2;
/// ... and from this many bytes, below which no setting would change what fits.
const FRAGMENTED_MIN_BYTES: u64 = 256 << 20;
/// One role holding this share of what was live is the one to fix first:
/// below a third, two or three roles share the memory and no single change
/// of one of them decides whether the run fits.
const DOMINANT_ROLE_SHARE: f64 = 0.3;
/// GPUs the sharding advice counts with when the snapshot holds one device:
/// a single node's worth.
const SHARD_EXAMPLE_GPUS: u64 = 8;
/// Bytes per element of the fp32 tensors the size match finds (gradients
/// and Adam's moments take the parameters' size).
const FP32_BYTES: u64 = 4;
/// Memory freed but held for other streams is reported from this much:
/// side streams normally hold a few buffers for a moment.
const PENDING_MIN_BYTES: u64 = 64 << 20;
/// The reserved peak must exceed the active peak by this much...
const OVERHEAD_MIN_BYTES: u64 = 1 << 30;
/// ... and by this share of the active peak to count as reserving far more than used.
const OVERHEAD_MIN_SHARE: f64 = 0.5;

/// Every finding for the devices, ranked; `expandable` says whether the
/// snapshot's allocator settings already had expandable segments on.
pub(crate) fn findings(reports: &[DeviceReport], expandable: bool) -> Vec<Finding> {
    let mut out = Vec::new();
    for r in reports {
        out.extend(
            r.ooms
                .iter()
                .take(OOMS_DETAILED)
                .map(|o| oom(r.device, o, expandable)),
        );
        out.extend(dominant_site(r));
        out.extend(dominant_role(r, reports.len() as u64));
        out.extend(r.phases.iter().filter_map(|p| phase_retains_memory(r, p)));
        if !expandable {
            // Advice to enable what is already on would be noise.
            out.extend(fragmentation(r));
        }
        out.extend(pending_free(r));
        out.extend(reserved_overhead(r));
    }
    oomkit_advice::rank(&mut out);
    out
}

/// What the verdict and the OOM finding know of one OOM entry of the trace.
pub(crate) fn failure(device: i64, o: &OomReport, expandable: bool) -> oomkit_advice::Failure {
    oomkit_advice::Failure {
        place: oomkit_advice::Place {
            device: Some(format!("cuda:{device}")),
            event: Some(o.event_index),
            stage: o.phase.clone(),
            ..Default::default()
        },
        figures: oomkit_advice::Figures {
            requested: Some(o.requested_bytes),
            free: Some(o.free_bytes),
            reserved_unallocated: Some(o.reserved_unallocated_bytes),
            free_at_failure: true,
            ..Default::default()
        },
        live: Some(o.live_bytes),
        site: Some(o.label.clone()),
        expandable_segments: expandable,
        largest_role: largest_role(&o.roles),
    }
}

/// An OOM entry of the trace, with the cause decided from the replayed figures.
fn oom(device: i64, o: &OomReport, expandable: bool) -> Finding {
    let kind = if o.cause == Cause::Fragmentation {
        FindingKind::OomFragmentation
    } else {
        FindingKind::OomCapacity
    };
    // The same first fix the verdict gives, fitted to the cause.
    let advice = oomkit_advice::first_fix(o.cause, &failure(device, o, expandable));
    Finding::new(
        kind,
        format!(
            "cuda:{device}: out of memory at event {}: {} requested at {} with {} live, {} reserved but unallocated, {} free on the device",
            o.event_index,
            human_bytes(o.requested_bytes),
            o.label,
            human_bytes(o.live_bytes),
            human_bytes(o.reserved_unallocated_bytes),
            human_bytes(o.free_bytes)
        ),
        advice,
    )
    .on_device(device)
    .at_event(o.event_index)
    .with_bytes(o.requested_bytes)
}

/// One source line holding a large share of the peak.
fn dominant_site(r: &DeviceReport) -> Option<Finding> {
    let top = r.top_sites.first()?;
    let peak = r.peak_active_bytes;
    if peak == 0 || top.site.is_none() || (top.bytes as f64) < DOMINANT_SHARE * peak as f64 {
        return None;
    }
    Some(
        Finding::new(
            FindingKind::DominantSite,
            format!(
                "cuda:{}: {} holds {} ({:.0}% of the {} peak) in {}",
                r.device,
                top.label,
                human_bytes(top.bytes),
                100.0 * top.bytes as f64 / peak as f64,
                human_bytes(peak),
                oomkit_units::count(top.count, "allocation", "allocations")
            ),
            "start there: free or shrink what this line keeps alive at the peak (activations saved for backward, cached outputs, optimizer state)",
        )
        .on_device(r.device)
        .with_bytes(top.bytes),
    )
}

/// The role holding the most bytes, unless only unknown bytes are live.
pub(crate) fn largest_role(roles: &RoleBytes) -> Option<(Role, u64)> {
    roles
        .largest()
        .filter(|&r| r != Role::Unknown)
        .map(|r| (r, *roles.get(r)))
}

/// One role holding a large share of what was live at the first OOM (or at
/// the peak without one), with the fix that shrinks it and by how much, from
/// the formulas `oomkit estimate` uses.
fn dominant_role(r: &DeviceReport, devices: u64) -> Option<Finding> {
    let (at, roles, live) = match r.ooms.first() {
        Some(o) => ("the OOM", &o.roles, o.live_bytes),
        None => ("the peak", &r.roles.peak, r.peak_active_bytes),
    };
    let (role, bytes) = largest_role(roles)?;
    if live == 0 || (bytes as f64) < DOMINANT_ROLE_SHARE * live as f64 {
        return None;
    }
    let b = human_bytes;
    let gpus = if devices > 1 {
        devices
    } else {
        SHARD_EXAMPLE_GPUS
    };
    let sharded = |x: u64| x - x / gpus;
    // What the device can hold, as far as an OOM tells: what this process
    // reserved plus what the driver still had free.
    let capacity = r.ooms.first().map(|o| o.reserved_bytes + o.free_bytes);
    let weights_fill_device = capacity.is_some_and(|c| roles.parameters >= c);
    let advice = match role {
        Role::Parameters => format!(
            "if they are fp32, bf16 weights halve them (saves about {}); sharding them over {gpus} GPUs (FSDP) saves about {}",
            b(bytes / 2),
            b(sharded(bytes))
        ),
        Role::Gradients => format!(
            "an optimizer step fused into backward (Tensor.register_post_accumulate_grad_hook) frees each gradient once applied (saves most of {}); if they are fp32, bf16 gradients save about {}; sharding them over {gpus} GPUs (ZeRO-2/FSDP) saves about {}",
            b(bytes),
            b(bytes / 2),
            b(sharded(bytes))
        ),
        Role::OptimizerState => {
            let adam = Optimizer::AdamW.state_bytes_per_param(FP32_BYTES);
            let eight_bit = Optimizer::AdamW8bit.state_bytes_per_param(FP32_BYTES);
            let per_grad = if roles.gradients > 0 {
                format!(
                    ", {:.1}x the gradients",
                    bytes as f64 / roles.gradients as f64
                )
            } else {
                String::new()
            };
            format!(
                "({} per parameter for AdamW in fp32{per_grad}): an 8-bit optimizer (bitsandbytes AdamW8bit, {eight_bit} bytes per parameter) saves about {}; sharding it over {gpus} GPUs (ZeRO-1/FSDP) saves about {}",
                oomkit_units::count(adam, "byte", "bytes"),
                b(bytes - bytes * eight_bit / adam),
                b(sharded(bytes))
            )
        }
        Role::Activations if weights_fill_device => format!(
            "but the parameters alone ({}) fill the device: no micro-batch fits until they are sharded (FSDP) or quantized",
            b(roles.parameters)
        ),
        Role::Activations => format!(
            "halving the micro-batch (with twice the gradient accumulation: `oomkit run` does both) saves about {}; activation checkpointing keeps only each checkpointed block's input, about 1/N of them for N blocks",
            b(bytes / 2)
        ),
        Role::Temporaries => format!(
            "they live within one stage: a chunked or fused loss (the logits' softmax is often the largest) and fused kernels (scaled_dot_product_attention) avoid most of them; the largest site at the peak is {}",
            r.top_sites.first().map_or("unknown", |s| s.label.as_str())
        ),
        Role::Inputs => "keep the data loader's batches on the CPU (pin_memory, non_blocking copies) and move only the micro-batch being computed".into(),
        Role::Other => "library buffers: NCCL's (NCCL_BUFFSIZE), cuBLAS workspaces (CUBLAS_WORKSPACE_CONFIG) and CUDA graph pools".into(),
        Role::Unknown => return None,
    };
    Some(
        Finding::new(
            FindingKind::DominantRole,
            format!(
                "cuda:{}: at {at}, {} ({:.0}% of the {} live) is {}",
                r.device,
                b(bytes),
                100.0 * bytes as f64 / live as f64,
                b(live),
                role.words()
            ),
            advice,
        )
        .on_device(r.device)
        .with_bytes(bytes)
        .about_role(role),
    )
}

/// A phase that ends with much more live than it began with.
fn phase_retains_memory(r: &DeviceReport, p: &PhaseReport) -> Option<Finding> {
    let retained = p.retained_bytes.max(0) as u64;
    let name = p.name.to_lowercase();
    // Forward keeps activations for backward by design, and an optimizer's
    // first step creates its state (AdamW: two tensors per parameter) and
    // keeps it: neither is a leak.
    let by_design = name.contains("forward")
        || (p.occurrences == 1 && (name.contains("optim") || name.contains(".step")));
    if by_design
        || retained < RETAINED_MIN_BYTES
        || (retained as f64) < RETAINED_MIN_SHARE * r.peak_active_bytes as f64
    {
        return None;
    }
    Some(
        Finding::new(
            FindingKind::PhaseRetainsMemory,
            format!(
                "cuda:{}: phase '{}' ended with {} more live than it started with: tensors created there outlive it",
                r.device,
                p.name,
                human_bytes(retained)
            ),
            "keep only what you need from that phase and move it off the GPU (.item(), .detach().cpu()); run evaluation under torch.no_grad()",
        )
        .on_device(r.device)
        .with_bytes(retained),
    )
}

/// Free memory inside segments that no request of this program can use.
///
/// Cached memory is not fragmentation: free blocks that can serve the
/// largest request this program makes are the cache doing its job. Only
/// free memory that in total could hold that request, with no piece that
/// can, makes the allocator reserve more than it needs.
fn fragmentation(r: &DeviceReport) -> Option<Finding> {
    let f = &r.fragmentation;
    let stranded = f.largest_free_block_bytes < f.largest_request_bytes
        && f.external_bytes >= f.largest_request_bytes;
    if !stranded
        || f.external_fraction < FRAGMENTED_MIN_FRACTION
        || f.external_bytes < FRAGMENTED_MIN_BYTES
    {
        return None;
    }
    Some(
        Finding::new(
            FindingKind::Fragmentation,
            format!(
                "cuda:{}: {} ({:.0}% of reserved) is free inside segments in {}, the largest {}, smaller than the {} blocks this program asks for: such a request needs new memory though the total is there",
                r.device,
                human_bytes(f.external_bytes),
                100.0 * f.external_fraction,
                oomkit_units::count(f.free_blocks, "piece", "pieces"),
                human_bytes(f.largest_free_block_bytes),
                human_bytes(f.largest_request_bytes)
            ),
            "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so freed blocks can be merged and reused",
        )
        .on_device(r.device)
        .with_bytes(f.external_bytes),
    )
}

/// Memory freed but held for other streams.
fn pending_free(r: &DeviceReport) -> Option<Finding> {
    let pending = r.pending_free_bytes;
    (pending >= PENDING_MIN_BYTES).then(|| {
        Finding::new(
            FindingKind::PendingFree,
            format!(
                "cuda:{}: {} is freed but held for other streams (record_stream)",
                r.device,
                human_bytes(pending)
            ),
            "synchronize the side stream earlier, or avoid Tensor.record_stream on large tensors",
        )
        .on_device(r.device)
        .with_bytes(pending)
    })
}

/// The allocator reserving far more than the program ever used.
fn reserved_overhead(r: &DeviceReport) -> Option<Finding> {
    let gap = r.peak_reserved_bytes.saturating_sub(r.peak_active_bytes);
    if r.events == 0
        || gap < OVERHEAD_MIN_BYTES
        || (gap as f64) < OVERHEAD_MIN_SHARE * r.peak_active_bytes as f64
    {
        return None;
    }
    Some(
        Finding::new(
            FindingKind::ReservedOverhead,
            format!(
                "cuda:{}: the allocator reserved up to {} for a peak of {} active, {} more than needed",
                r.device,
                human_bytes(r.peak_reserved_bytes),
                human_bytes(r.peak_active_bytes),
                human_bytes(gap)
            ),
            "cached segments are not being reused: try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        )
        .on_device(r.device)
        .with_bytes(gap),
    )
}
