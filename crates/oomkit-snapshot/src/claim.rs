//! Turning trace entries into events while the pickle is parsed, so that a
//! million-entry trace never exists as a million generic dicts.

use crate::model::{Action, Interned, TraceEvent};
use crate::slots::SlotCache;
use crate::stack_reader::StackReader;
use oomkit_pickle::{Claim, Document, Slot};

/// Which field of a trace entry a key names.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryField {
    Action,
    Addr,
    Size,
    TimeUs,
    Frames,
    DeviceFree,
    Stream,
    Pool,
    Other,
}

impl EntryField {
    pub(crate) fn of(key: &[u8]) -> EntryField {
        match key {
            b"action" => EntryField::Action,
            b"addr" => EntryField::Addr,
            b"size" => EntryField::Size,
            b"time_us" => EntryField::TimeUs,
            b"frames" => EntryField::Frames,
            b"device_free" => EntryField::DeviceFree,
            b"stream" => EntryField::Stream,
            b"segment_pool_id" => EntryField::Pool,
            _ => EntryField::Other,
        }
    }
}

/// Turns trace entries into [`TraceEvent`]s while the pickle is parsed, so
/// that a million-entry trace never exists as a million generic dicts.
///
/// Entries it cannot read exactly (an unknown action, a field of the wrong
/// type) are left to the generic reader, which counts or reports them.
/// Where each field sits in the dicts of one key sequence.
///
/// Every entry of a trace repeats the same memoized keys in the same order,
/// so one comparison per key finds the fields, with no lookup or branch per
/// field.
#[derive(Default)]
struct Shape {
    keys: Vec<Slot>,
    /// Index of the value of each field in the items, the last if repeated.
    action: Option<usize>,
    addr: Option<usize>,
    size: Option<usize>,
    time_us: Option<usize>,
    frames: Option<usize>,
    device_free: Option<usize>,
    stream: Option<usize>,
    pool: Option<usize>,
}

pub(crate) struct EntryClaim {
    pub(crate) stacks: StackReader,
    pub(crate) events: Vec<TraceEvent>,
    pub(crate) interned: Interned,
    shape: Shape,
    keys: SlotCache<EntryField>,
    actions: SlotCache<Action>,
}

/// Size of the direct-mapped caches of key and action strings.
const KEY_BUCKETS: usize = 64;
/// How much of the events' spare capacity one parse step names as about to be filled.
const EVENTS_AHEAD: usize = 2 << 20;
impl EntryClaim {
    pub(crate) fn new(file_len: usize) -> Self {
        let events = Vec::with_capacity(file_len / 32);
        oomkit_pickle::advise_huge_pages(&events);
        EntryClaim {
            stacks: StackReader::default(),
            // An entry takes at least 32 bytes of pickle; reserved pages that
            // are never touched cost no resident memory, while growing by
            // doubling would briefly hold two copies of the events.
            events,
            interned: Interned::default(),
            shape: Shape::default(),
            keys: SlotCache::new(KEY_BUCKETS),
            actions: SlotCache::new(KEY_BUCKETS),
        }
    }

    fn field(&mut self, doc: &Document<'_>, key: Slot) -> Option<EntryField> {
        if let Some(f) = self.keys.get(key) {
            return Some(f);
        }
        let f = EntryField::of(doc.str_bytes(key)?);
        // Keys are shared through the memo, so a few slots cover a whole trace.
        self.keys.put(key, f);
        Some(f)
    }

    fn action(&mut self, doc: &Document<'_>, slot: Slot) -> Option<Action> {
        if let Some(a) = self.actions.get(slot) {
            return Some(a);
        }
        let a = Action::parse(doc.str_bytes(slot)?);
        self.actions.put(slot, a);
        Some(a)
    }

    /// Makes the cached shape that of `items`, returning `None` if a key is not a string.
    fn shape(&mut self, doc: &Document<'_>, items: &[Slot]) -> Option<()> {
        let same = self.shape.keys.len() * 2 == items.len()
            && items
                .iter()
                .step_by(2)
                .zip(&self.shape.keys)
                .all(|(a, b)| a == b);
        if same {
            return Some(());
        }
        let mut shape = Shape::default();
        for (i, &k) in items.iter().step_by(2).enumerate() {
            let at = Some(2 * i + 1);
            match self.field(doc, k)? {
                EntryField::Action => shape.action = at,
                EntryField::Addr => shape.addr = at,
                EntryField::Size => shape.size = at,
                EntryField::TimeUs => shape.time_us = at,
                EntryField::Frames => shape.frames = at,
                EntryField::DeviceFree => shape.device_free = at,
                EntryField::Stream => shape.stream = at,
                EntryField::Pool => shape.pool = at,
                EntryField::Other => {}
            }
            shape.keys.push(k);
        }
        self.shape = shape;
        Some(())
    }

    fn read(&mut self, doc: &Document<'_>, items: &[Slot]) -> Option<TraceEvent> {
        self.shape(doc, items)?;
        let uint = |at: Option<usize>| match at {
            Some(i) => doc.as_i128(items[i]).and_then(|v| u64::try_from(v).ok()),
            None => Some(0),
        };
        let mut ev = TraceEvent::BLANK;
        ev.action = self.action(doc, items[self.shape.action?])?;
        if ev.action == Action::Unknown {
            return None;
        }
        ev.addr = uint(self.shape.addr)?;
        ev.size = uint(self.shape.size)?;
        if let Some(i) = self.shape.time_us {
            ev.set_time(doc.as_i64(items[i]));
        }
        if let Some(i) = self.shape.frames {
            ev.stack = self.stacks.stack(doc, items[i], String::new).ok()?;
        }
        if let Some(i) = self.shape.stream {
            // An odd stream value costs the model its stream, not the entry.
            ev.stream = self.interned.stream(doc.as_i64(items[i]).unwrap_or(0));
        }
        if let Some(i) = self.shape.pool {
            ev.pool = self.interned.pool(pool_id(doc, items[i])?);
        }
        if let (Action::Oom, Some(_)) = (ev.action, self.shape.device_free) {
            ev.addr = uint(self.shape.device_free)?;
        }
        Some(ev)
    }
}

/// Reads a `segment_pool_id`: a pair of integers, as a tuple or a list.
pub(crate) fn pool_id(doc: &Document<'_>, slot: Slot) -> Option<(i64, i64)> {
    match doc.seq(slot)? {
        [a, b] => Some((doc.as_i64(*a)?, doc.as_i64(*b)?)),
        _ => None,
    }
}

impl Claim for EntryClaim {
    fn ahead(&self, ahead: &mut oomkit_pickle::Ahead) {
        ahead.add(&self.events, EVENTS_AHEAD);
    }

    fn claim(&mut self, doc: &Document<'_>, items: &[Slot]) -> Option<u32> {
        let id = u32::try_from(self.events.len()).ok()?;
        let ev = self.read(doc, items)?;
        self.events.push(ev);
        Some(id)
    }

    fn claim_list(&mut self, doc: &Document<'_>, items: &[Slot]) -> Option<u32> {
        self.stacks.claim_list(doc, items)
    }
}
