//! The cause of one failed allocation, decided from whatever figures the source has.

use serde::Serialize;

/// Why the allocation failed; the JSON strings are the documented cause vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Enough memory was reserved but free only in pieces too small for the request.
    Fragmentation,
    /// The process genuinely needed more memory than there was.
    Capacity,
    /// One allocation asked for more than the whole device.
    RequestExceedsCapacity,
    /// Other processes held the memory the request needed.
    OtherProcesses,
    /// The process reached its own cap (`set_per_process_memory_fraction`) while the device had room.
    MemoryFractionLimit,
}

impl Cause {
    /// The cause as its JSON string, for text that names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Fragmentation => "fragmentation",
            Cause::Capacity => "capacity",
            Cause::RequestExceedsCapacity => "request_exceeds_capacity",
            Cause::OtherProcesses => "other_processes",
            Cause::MemoryFractionLimit => "memory_fraction_limit",
        }
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// More memory than any single accelerator has (the largest hold under
/// 300 GB), so a request above it cannot fit whatever the device.
pub const LARGEST_DEVICE_BYTES: u64 = 1 << 40;

/// What is known about memory at the failing request; `None` where the source lacks it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Figures {
    /// Bytes the failed allocation asked for.
    pub requested: Option<u64>,
    /// Memory on the device.
    pub capacity: Option<u64>,
    /// Memory the driver reported free.
    pub free: Option<u64>,
    /// Memory PyTorch had reserved but not handed to tensors.
    pub reserved_unallocated: Option<u64>,
    /// The process's own cap, where one was set.
    pub allowed: Option<u64>,
    /// Memory other processes held on the device.
    pub other_processes: u64,
    /// `free` was read by the allocator as the request failed and the source
    /// cannot say whether the process had a cap (a snapshot's OOM entry):
    /// room on the device then points to one.
    pub free_at_failure: bool,
}

/// Room the driver must have had beyond the request before a failure read
/// at that moment is taken as the process's own limit: cudaMalloc serves
/// any request below what it reports free, give or take its page rounding.
pub const PROCESS_LIMIT_SLACK_BYTES: u64 = 64 << 20;

/// Whether the driver had room for the request when it failed: the limit that
/// stopped it was then not the device's free memory but the process's own
/// (`set_per_process_memory_fraction`, which a snapshot does not record), or,
/// more rarely, a driver that would not give one piece that large.
pub fn room_on_device(requested: u64, free_at_failure: u64) -> bool {
    free_at_failure >= requested.saturating_add(PROCESS_LIMIT_SLACK_BYTES)
}

impl Figures {
    /// Bytes that would have had to be free for the request to succeed, where both figures are known.
    pub fn shortfall(&self) -> Option<u64> {
        Some(self.requested?.saturating_sub(self.free?))
    }
}

/// Decides the cause from the figures, in order of what a fix would need:
/// nothing fits a request larger than the device; reserved pieces that
/// together hold the request need only the allocator's settings; a cap of
/// the process's own with room on the device needs only the cap raised;
/// other processes that hold at least the shortfall need another GPU; the
/// rest is capacity, which needs less memory.
pub fn decide(f: &Figures) -> Cause {
    let Some(request) = f.requested else {
        return Cause::Capacity;
    };
    let unallocated = f.reserved_unallocated.unwrap_or(0);
    // Where the capacity is unknown (a snapshot does not record it), a
    // request beyond any accelerator made is still larger than the device.
    let capacity = f.capacity.unwrap_or(LARGEST_DEVICE_BYTES);
    if request > capacity {
        Cause::RequestExceedsCapacity
    } else if unallocated > 0 && unallocated >= request {
        Cause::Fragmentation
    } else if f.allowed.is_some() && f.free.is_some_and(|free| free >= request)
        || f.free_at_failure && f.free.is_some_and(|free| room_on_device(request, free))
    {
        Cause::MemoryFractionLimit
    } else if f.other_processes > 0 && f.shortfall().is_some_and(|s| f.other_processes >= s) {
        Cause::OtherProcesses
    } else {
        Cause::Capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn each_cause_from_its_figures() {
        let base = Figures {
            requested: Some(2 * GIB),
            capacity: Some(80 * GIB),
            free: Some(GIB),
            ..Figures::default()
        };
        assert_eq!(decide(&base), Cause::Capacity);
        let huge = Figures {
            requested: Some(100 * GIB),
            ..base
        };
        assert_eq!(decide(&huge), Cause::RequestExceedsCapacity);
        let pieces = Figures {
            reserved_unallocated: Some(6 * GIB),
            ..base
        };
        assert_eq!(decide(&pieces), Cause::Fragmentation);
        let capped = Figures {
            allowed: Some(40 * GIB),
            free: Some(9 * GIB),
            ..base
        };
        assert_eq!(decide(&capped), Cause::MemoryFractionLimit);
        // A snapshot's OOM entry: room on the device when the request failed.
        let roomy = Figures {
            free: Some(9 * GIB),
            free_at_failure: true,
            ..base
        };
        assert_eq!(decide(&roomy), Cause::MemoryFractionLimit);
        // Read later (a run log, after the step's tensors were freed), room says nothing.
        assert_eq!(
            decide(&Figures {
                free_at_failure: false,
                ..roomy
            }),
            Cause::Capacity
        );
        let tight = Figures {
            free: Some(2 * GIB + (32 << 20)),
            ..roomy
        };
        assert_eq!(decide(&tight), Cause::Capacity);
        let crowded = Figures {
            other_processes: 60 * GIB,
            ..base
        };
        assert_eq!(decide(&crowded), Cause::OtherProcesses);
        assert_eq!(decide(&Figures::default()), Cause::Capacity);
    }

    #[test]
    fn the_strings_are_the_documented_ones() {
        for c in [
            Cause::Fragmentation,
            Cause::Capacity,
            Cause::RequestExceedsCapacity,
            Cause::OtherProcesses,
            Cause::MemoryFractionLimit,
        ] {
            let json = serde_json::to_string(&c).expect("serializes");
            assert_eq!(json, format!("\"{}\"", c.as_str()));
        }
    }
}
