//! Interning a document's stacks: each list of frame dicts becomes a
//! [`StackId`], each frame dict a [`FrameId`], remembering the lists and
//! frames PyTorch shares so that a repeated one costs one probe.

use crate::error::Result;
use crate::hash::{FastHasher, FastState};
use crate::slots::{field_err, SlotCache};
use crate::stacks::{Frame, FrameId, StackId, Stacks};
use oomkit_pickle::{Document, Kind, Slot, Value};
use std::collections::HashMap;

/// Size of the direct-mapped cache in front of the stack table.
pub(crate) const STACK_BUCKETS: usize = 4096;

/// Interns the stacks of a document, remembering each shared frame list once.
pub(crate) struct StackReader {
    stacks: Stacks,
    recent: SlotCache<StackId>,
    stack_cache: HashMap<Slot, StackId, FastState>,
    frame_cache: HashMap<Slot, FrameId, FastState>,
    /// Stacks by a hash of the frame slots they hold, with where those
    /// slots are kept in `seen_slots`: PyTorch writes a new list per
    /// traceback but shares the frame dicts, so most lists repeat the slots
    /// of an earlier one.
    by_slots: HashMap<u64, (usize, usize, StackId), FastState>,
    seen_slots: Vec<Slot>,
}

/// Hashes a list of slots in four independent lanes: a frames list holds
/// about thirty slots, and one multiply chain over all of them would be
/// most of the cost of recognising a repeated list.
fn hash_slots(items: &[Slot]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut lanes = [FastHasher::default(); 4];
    let mut chunks = items.chunks_exact(4);
    for c in &mut chunks {
        for (lane, s) in lanes.iter_mut().zip(c) {
            s.hash(lane);
        }
    }
    for (lane, s) in lanes.iter_mut().zip(chunks.remainder()) {
        s.hash(lane);
    }
    let mut h = FastHasher::default();
    h.write_usize(items.len());
    for lane in lanes {
        h.write_u64(lane.finish());
    }
    h.finish()
}

impl Default for StackReader {
    fn default() -> Self {
        StackReader {
            stacks: Stacks::default(),
            recent: SlotCache::new(STACK_BUCKETS),
            stack_cache: HashMap::default(),
            frame_cache: HashMap::default(),
            by_slots: HashMap::default(),
            seen_slots: Vec::new(),
        }
    }
}

impl StackReader {
    /// The stacks interned so far, for the snapshot.
    pub(crate) fn into_stacks(self) -> Stacks {
        self.stacks
    }

    pub(crate) fn stack(
        &mut self,
        doc: &Document<'_>,
        frames: Slot,
        at: impl FnOnce() -> String,
    ) -> Result<StackId> {
        // A list the claim took over was interned then, and its number is the stack.
        if let Some(id) = doc.claimed_list(frames) {
            return Ok(StackId(id));
        }
        // Every trace entry names its stack; a direct-mapped cache answers
        // most of them without probing the table.
        if let Some(id) = self.recent.get(frames) {
            return Ok(id);
        }
        if let Some(&id) = self.stack_cache.get(&frames) {
            self.recent.put(frames, id);
            return Ok(id);
        }
        let items = match doc.kind(frames) {
            Some(Kind::List | Kind::Tuple) => doc.seq(frames).unwrap_or(&[]),
            _ if matches!(doc.value(frames), Value::None) => &[],
            _ => return Err(field_err(doc, at, frames, "a list of frames")),
        };
        let id = self.intern(doc, items);
        self.stack_cache.insert(frames, id);
        self.recent.put(frames, id);
        Ok(id)
    }

    /// Interns the stack of a list of frame dicts.
    pub(crate) fn intern(&mut self, doc: &Document<'_>, items: &[Slot]) -> StackId {
        let hash = hash_slots(items);
        if let Some(id) = self.seen(hash, items) {
            return id;
        }
        let mut ids = Vec::with_capacity(items.len());
        for &f in items {
            let id = match self.frame_cache.get(&f) {
                Some(&id) => id,
                None => {
                    let get = |k: &str| doc.dict_get(f, k);
                    let frame = Frame {
                        filename: get("filename")
                            .and_then(|s| doc.as_str(s))
                            .unwrap_or("")
                            .into(),
                        line: get("line").and_then(|s| doc.as_i64(s)).unwrap_or(0),
                        name: get("name").and_then(|s| doc.as_str(s)).unwrap_or("").into(),
                    };
                    let id = self.stacks.intern_frame(frame);
                    self.frame_cache.insert(f, id);
                    id
                }
            };
            ids.push(id);
        }
        let id = self.stacks.intern_stack(ids);
        // On a hash collision the older list keeps the entry; the newer one
        // is simply interned the long way each time.
        if let std::collections::hash_map::Entry::Vacant(v) = self.by_slots.entry(hash) {
            v.insert((self.seen_slots.len(), items.len(), id));
            self.seen_slots.extend_from_slice(items);
        }
        id
    }

    /// Returns the stack of an earlier list that held exactly `items`.
    pub(crate) fn seen(&self, hash: u64, items: &[Slot]) -> Option<StackId> {
        let &(start, len, id) = self.by_slots.get(&hash)?;
        (self.seen_slots[start..start + len] == *items).then_some(id)
    }

    /// Interns a list of frames that the parser offers to claim, if every
    /// item is a frame dict (or the list repeats one already read as
    /// frames); anything else stays in the document.
    pub(crate) fn claim_list(&mut self, doc: &Document<'_>, items: &[Slot]) -> Option<u32> {
        if let Some(id) = self.seen(hash_slots(items), items) {
            return Some(id.0);
        }
        let frames = items.iter().all(|f| {
            self.frame_cache.contains_key(f)
                || (doc.dict_get(*f, "filename").is_some() && doc.dict_get(*f, "name").is_some())
        });
        frames.then(|| self.intern(doc, items).0)
    }
}
