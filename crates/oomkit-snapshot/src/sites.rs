//! Allocation sites: which user line asked for each block, and the live set grouped by it.

use crate::report::SiteBytes;
use crate::stacks::{Frame, Site, StackId, Stacks};
use std::collections::HashMap;

/// Where an allocation came from: the user frame, or why there is none.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum SiteKey {
    Frame(u32),
    Native(u32),
    NoPythonFrame,
    NoStack,
    BeforeRecording,
}

/// A live allocation during replay.
#[derive(Clone, Copy)]
pub(crate) struct Live {
    pub(crate) size: u64,
    /// The bytes the program asked for, which the trace's entries record
    /// and a gradient's size is matched on (the block's size is rounded).
    pub(crate) requested: u64,
    pub(crate) stack: StackId,
    pub(crate) before_recording: bool,
    /// The block lives in a private pool's segment (a CUDA graph's).
    pub(crate) private_pool: bool,
    /// The trace entry that allocated it, or [`Live::UNTRACED`], or for a
    /// block the trace freed but did not allocate, [`Live::freed_by`] the
    /// entry that freed it.
    pub(crate) at: u32,
}

impl Live {
    /// `at` of a block the trace did not allocate (or whose entry is not known here).
    pub(crate) const UNTRACED: u32 = u32::MAX;
    /// Set in `at` for a block the trace freed but did not allocate, with
    /// the freeing entry below it: the parser numbers entries in 32 bits,
    /// and a trace of 2^31 entries (64 GiB of events) is not read whole.
    const FREED: u32 = 1 << 31;

    /// `at` of a block that predates the trace and was freed at `entry`.
    pub(crate) fn freed_by(entry: usize) -> u32 {
        Live::FREED | entry as u32
    }

    /// The entry that freed a block the trace did not allocate, if it did.
    pub(crate) fn freeing_entry(&self) -> Option<usize> {
        (self.at != Live::UNTRACED && self.at & Live::FREED != 0)
            .then_some((self.at & !Live::FREED) as usize)
    }
}

pub(crate) fn site_key(stacks: &Stacks, live: &Live) -> SiteKey {
    if live.before_recording && live.stack == StackId::EMPTY {
        return SiteKey::BeforeRecording;
    }
    if live.stack == StackId::EMPTY {
        return SiteKey::NoStack;
    }
    match stacks.site(live.stack) {
        Site::Frame(f) => SiteKey::Frame(f),
        Site::Native(n) => SiteKey::Native(n),
        Site::Unknown => SiteKey::NoPythonFrame,
    }
}

pub(crate) fn label(stacks: &Stacks, key: &SiteKey) -> (Option<Frame>, String) {
    match key {
        SiteKey::Frame(f) => {
            let fr = stacks.frame(*f).clone();
            let short = fr.filename.rsplit('/').next().unwrap_or(&fr.filename);
            let text = format!("{short}:{} {}", fr.line, fr.name);
            (Some(fr), text)
        }
        SiteKey::Native(n) => (None, format!("<{}>", stacks.native_name(*n))),
        SiteKey::NoPythonFrame => (None, "<no Python frame: native code only>".into()),
        SiteKey::NoStack => (None, "<no stack recorded>".into()),
        SiteKey::BeforeRecording => (None, "<allocated before recording started>".into()),
    }
}

/// Describes where the allocation with this stack came from, in the same
/// words the site tables use.
pub fn stack_label(stacks: &Stacks, stack: StackId) -> String {
    let live = Live {
        size: 0,
        requested: 0,
        stack,
        before_recording: false,
        private_pool: false,
        at: Live::UNTRACED,
    };
    label(stacks, &site_key(stacks, &live)).1
}

/// Groups live allocations by site, largest first.
pub(crate) fn group(
    stacks: &Stacks,
    live: impl Iterator<Item = Live>,
    top: usize,
) -> Vec<SiteBytes> {
    let mut groups: HashMap<SiteKey, (u64, u64, Live)> = HashMap::new();
    for l in live {
        let e = groups.entry(site_key(stacks, &l)).or_insert((0, 0, l));
        e.0 += l.size;
        e.1 += 1;
        // The first of equal sizes stays, so the stack shown does not
        // depend on hashing: live sets come oldest allocation first.
        if l.size > e.2.size {
            e.2 = l;
        }
    }
    // Ties go by label, not by interning order, so the report does not
    // depend on the order in which the reader met the stacks.
    let mut v: Vec<_> = groups
        .into_iter()
        .map(|(key, g)| (label(stacks, &key), key, g))
        .collect();
    v.sort_by(|a, b| {
        b.2 .0
            .cmp(&a.2 .0)
            .then_with(|| a.0 .1.cmp(&b.0 .1))
            .then(a.1.cmp(&b.1))
    });
    v.into_iter()
        .take(top)
        .map(|((site, label), _, (bytes, count, largest))| SiteBytes {
            site,
            label,
            bytes,
            count,
            stack: stacks
                .stack(largest.stack)
                .iter()
                .map(|&f| stacks.frame(f).clone())
                .collect(),
        })
        .collect()
}
