//! The typed snapshot and its reader, for every layout from torch 2.0 to today.

use crate::error::{Error, Result};
use crate::hash::{FastHasher, FastState};
use crate::stacks::{Frame, FrameId, StackId, Stacks};
use oomkit_pickle::{Claim, Document, Kind, Slot, Value};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// The state of a block inside a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockState {
    /// Handed out to a tensor.
    ActiveAllocated,
    /// Freed by the program but kept until other streams finish with it.
    ActivePendingFree,
    /// Free space inside the segment.
    Inactive,
    /// A state this reader does not know.
    Unknown,
}

impl BlockState {
    /// Returns true if the allocator counts the block as active.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            BlockState::ActiveAllocated | BlockState::ActivePendingFree
        )
    }
}

/// A block of a segment, as the allocator saw it at snapshot time.
#[derive(Clone, Debug)]
pub struct Block {
    /// Device address.
    pub address: u64,
    /// Size after the allocator's rounding.
    pub size: u64,
    /// Size the program asked for.
    pub requested_size: u64,
    /// Allocation state.
    pub state: BlockState,
    /// Stack that allocated it, or the empty stack.
    pub stack: StackId,
}

/// A segment: one `cudaMalloc` (or expandable mapping) held by the caching allocator.
#[derive(Clone, Debug)]
pub struct Segment {
    /// CUDA device index.
    pub device: i64,
    /// Device address of the first byte.
    pub address: u64,
    /// Bytes reserved from the driver.
    pub total_size: u64,
    /// Bytes in `active_allocated` blocks.
    pub allocated_size: u64,
    /// Bytes in active blocks, pending frees included.
    pub active_size: u64,
    /// Bytes the program asked for in active blocks.
    pub requested_size: u64,
    /// The CUDA stream the segment belongs to.
    pub stream: u64,
    /// `large` or `small` pool, empty when not recorded.
    pub segment_type: String,
    /// True for expandable segments.
    pub is_expandable: bool,
    /// The segment belongs to a private pool (`segment_pool_id` other than
    /// `(0, 0)`): a CUDA graph's, or one a `torch.cuda.MemPool` made.
    pub private_pool: bool,
    /// The blocks, in address order.
    pub blocks: Vec<Block>,
}

/// What a trace entry records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// A block was handed out.
    Alloc,
    /// The program freed a block; other streams may still use it.
    FreeRequested,
    /// The block became free for reuse.
    FreeCompleted,
    /// A segment was reserved with `cudaMalloc`.
    SegmentAlloc,
    /// A segment was released with `cudaFree`.
    SegmentFree,
    /// Pages were mapped into an expandable segment.
    SegmentMap,
    /// Pages were unmapped from an expandable segment.
    SegmentUnmap,
    /// `_snapshot()` was called.
    Snapshot,
    /// An allocation failed: `size` was requested, `addr` holds the driver's free bytes.
    Oom,
    /// A user annotation (`torch.cuda.memory._record_memory_history` metadata).
    Annotate,
    /// An action this reader does not know; counted, not fatal.
    Unknown,
}

impl Action {
    /// Every action, in declaration order, so that `ALL[a as usize] == a`.
    pub const ALL: [Action; 11] = [
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::SegmentMap,
        Action::SegmentUnmap,
        Action::Snapshot,
        Action::Oom,
        Action::Annotate,
        Action::Unknown,
    ];

    fn parse(s: &[u8]) -> Action {
        match s {
            b"alloc" => Action::Alloc,
            b"free_requested" => Action::FreeRequested,
            b"free_completed" => Action::FreeCompleted,
            b"segment_alloc" => Action::SegmentAlloc,
            b"segment_free" => Action::SegmentFree,
            b"segment_map" => Action::SegmentMap,
            b"segment_unmap" => Action::SegmentUnmap,
            b"snapshot" => Action::Snapshot,
            b"oom" => Action::Oom,
            b"annotate" => Action::Annotate,
            _ => Action::Unknown,
        }
    }

    /// Returns the action's name as PyTorch writes it.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Snapshot => "snapshot",
            Action::Oom => "oom",
            Action::Annotate => "annotate",
            Action::Unknown => "unknown",
        }
    }
}

/// One entry of a device's allocation trace.
#[derive(Clone, Copy)]
pub struct TraceEvent {
    /// What happened.
    pub action: Action,
    /// Address, or for `oom` the bytes the driver reported free.
    pub addr: u64,
    /// Size, or for `oom` the bytes requested.
    pub size: u64,
    /// Stack of the call, or the empty stack.
    pub stack: StackId,
    /// Microseconds since the epoch, or [`NO_TIME`]; an `Option<i64>` would
    /// make every event 40 bytes instead of 32.
    time_us: i64,
}

impl std::fmt::Debug for TraceEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceEvent")
            .field("action", &self.action)
            .field("addr", &self.addr)
            .field("size", &self.size)
            .field("time_us", &self.time_us())
            .field("stack", &self.stack)
            .finish()
    }
}

/// Marks an entry without `time_us`.
const NO_TIME: i64 = i64::MIN;

impl TraceEvent {
    /// An entry before its fields are read.
    pub(crate) const BLANK: TraceEvent = TraceEvent {
        action: Action::Unknown,
        addr: 0,
        size: 0,
        stack: StackId::EMPTY,
        time_us: NO_TIME,
    };

    /// Returns when the entry was recorded, in microseconds since the epoch; absent before torch 2.2.
    pub fn time_us(&self) -> Option<i64> {
        (self.time_us != NO_TIME).then_some(self.time_us)
    }

    fn set_time(&mut self, t: Option<i64>) {
        // i64::MIN is not a plausible time; reading it as absent loses nothing.
        self.time_us = t.unwrap_or(NO_TIME);
    }
}

/// The trace of one device: a ring buffer of the most recent entries.
#[derive(Clone, Debug, Default)]
pub struct DeviceTrace {
    /// Entries, oldest first.
    pub events: Vec<TraceEvent>,
    /// Names and counts of actions this reader did not know.
    pub unknown_actions: BTreeMap<String, u64>,
}

/// Whether an annotation opens or closes a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Stage {
    /// The range starts.
    Start,
    /// The range ends.
    End,
}

/// A `record_function` range boundary from `external_annotations`.
#[derive(Clone, Debug)]
pub struct Annotation {
    /// The range name, e.g. `Optimizer.step#AdamW.step`.
    pub name: String,
    /// Start or end.
    pub stage: Stage,
    /// CUDA device index.
    pub device: i64,
    /// Microseconds since the epoch.
    pub time_us: i64,
}

/// Which of the known file layouts the snapshot used.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Layout {
    /// The pickle protocol.
    pub protocol: u8,
    /// The file is a bare list of segments (`torch.cuda.memory_snapshot()`).
    pub legacy_segment_list: bool,
    /// Blocks carry `history` instead of `address` and `frames` (torch 2.0).
    pub block_history: bool,
    /// Trace entries carry `time_us`.
    pub trace_times: bool,
}

/// A whole PyTorch memory snapshot.
#[derive(Debug)]
pub struct Snapshot {
    /// Segments at snapshot time.
    pub segments: Vec<Segment>,
    /// Allocation traces, indexed by device.
    pub traces: Vec<DeviceTrace>,
    /// `allocator_settings`, as JSON, when present.
    pub allocator_settings: Option<serde_json::Value>,
    /// `external_annotations`, when present.
    pub annotations: Vec<Annotation>,
    /// Interned frames and stacks.
    pub stacks: Stacks,
    /// What layout the file used.
    pub layout: Layout,
}

impl Snapshot {
    /// Reads a snapshot from a parsed pickle.
    pub fn from_document(doc: &Document<'_>) -> Result<Snapshot> {
        Reader::new(doc).read()
    }

    /// Parses pickle bytes and reads the snapshot in them, turning trace
    /// entries into events while parsing (see [`Snapshot::load`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<Snapshot> {
        Self::read_streaming(bytes, &mut |_, _| {})
    }

    /// Parses with trace entries claimed as they complete, so that the
    /// generic arena never holds them.
    fn read_streaming(
        bytes: &[u8],
        progress: &mut dyn FnMut(usize, &oomkit_pickle::Ahead),
    ) -> Result<Snapshot> {
        let mut claim = EntryClaim::new(bytes.len());
        let doc = Document::parse_claiming(
            bytes,
            &oomkit_pickle::Limits::default(),
            progress,
            &mut claim,
        )?;
        Reader {
            doc: &doc,
            stacks: claim.stacks,
            claimed: claim.events,
        }
        .read()
    }

    /// Returns the trace entries of a device, empty where it has none.
    pub fn events(&self, device: i64) -> &[TraceEvent] {
        usize::try_from(device)
            .ok()
            .and_then(|i| self.traces.get(i))
            .map_or(&[], |t| &t.events[..])
    }

    /// Returns the devices that have segments or trace entries, in order.
    pub fn devices(&self) -> Vec<i64> {
        let mut d: Vec<i64> = self.segments.iter().map(|s| s.device).collect();
        for (i, t) in self.traces.iter().enumerate() {
            if !t.events.is_empty() {
                d.push(i as i64);
            }
        }
        d.sort_unstable();
        d.dedup();
        d
    }
}

fn type_name(doc: &Document<'_>, s: Slot) -> &'static str {
    match doc.value(s) {
        Value::None => "None",
        Value::Bool(_) => "bool",
        Value::Int(_) | Value::BigInt(_) => "int",
        Value::Float(_) => "float",
        Value::Str(_) => "str",
        Value::Bytes(_) => "bytes",
        Value::ByteArray(_) => "bytearray",
        Value::Container(Kind::Dict) => "dict",
        Value::Container(Kind::List) => "list",
        Value::Container(Kind::Tuple) => "tuple",
        Value::Container(_) => "set",
    }
}

fn field_err(doc: &Document<'_>, at: impl FnOnce() -> String, slot: Slot, want: &str) -> Error {
    Error::Field {
        at: at(),
        problem: format!("expected {want}, found {}", type_name(doc, slot)),
    }
}

/// Interns the stacks of a document, remembering each shared frame list once.
struct StackReader {
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
    fn stack(
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
    fn intern(&mut self, doc: &Document<'_>, items: &[Slot]) -> StackId {
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
    fn seen(&self, hash: u64, items: &[Slot]) -> Option<StackId> {
        let &(start, len, id) = self.by_slots.get(&hash)?;
        (self.seen_slots[start..start + len] == *items).then_some(id)
    }

    /// Interns a list of frames that the parser offers to claim, if every
    /// item is a frame dict (or the list repeats one already read as
    /// frames); anything else stays in the document.
    fn claim_list(&mut self, doc: &Document<'_>, items: &[Slot]) -> Option<u32> {
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

/// Which field of a trace entry a key names.
#[derive(Clone, Copy, PartialEq, Eq)]
enum EntryField {
    Action,
    Addr,
    Size,
    TimeUs,
    Frames,
    DeviceFree,
    Other,
}

impl EntryField {
    fn of(key: &[u8]) -> EntryField {
        match key {
            b"action" => EntryField::Action,
            b"addr" => EntryField::Addr,
            b"size" => EntryField::Size,
            b"time_us" => EntryField::TimeUs,
            b"frames" => EntryField::Frames,
            b"device_free" => EntryField::DeviceFree,
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
}

struct EntryClaim {
    stacks: StackReader,
    events: Vec<TraceEvent>,
    shape: Shape,
    keys: SlotCache<EntryField>,
    actions: SlotCache<Action>,
}

/// Size of the direct-mapped caches of key and action strings.
const KEY_BUCKETS: usize = 64;
/// How much of the events' spare capacity one parse step names as about to be filled.
const EVENTS_AHEAD: usize = 2 << 20;
/// Size of the direct-mapped cache in front of the stack table.
const STACK_BUCKETS: usize = 4096;

/// A direct-mapped cache from slots to small values: one probe, no
/// collision chains, a colliding slot simply replaces the older one.
struct SlotCache<T: Copy> {
    buckets: Vec<Option<(Slot, T)>>,
}

impl<T: Copy> SlotCache<T> {
    /// Makes a cache of `n` buckets, a power of two.
    fn new(n: usize) -> Self {
        debug_assert!(n.is_power_of_two());
        SlotCache {
            buckets: vec![None; n],
        }
    }

    fn bucket(&self, slot: Slot) -> usize {
        let mut h = FastHasher::default();
        std::hash::Hash::hash(&slot, &mut h);
        std::hash::Hasher::finish(&h) as usize & (self.buckets.len() - 1)
    }

    fn get(&self, slot: Slot) -> Option<T> {
        match self.buckets[self.bucket(slot)] {
            Some((s, v)) if s == slot => Some(v),
            _ => None,
        }
    }

    fn put(&mut self, slot: Slot, value: T) {
        let at = self.bucket(slot);
        self.buckets[at] = Some((slot, value));
    }
}

impl EntryClaim {
    fn new(file_len: usize) -> Self {
        let events = Vec::with_capacity(file_len / 32);
        oomkit_pickle::advise_huge_pages(&events);
        EntryClaim {
            stacks: StackReader::default(),
            // An entry takes at least 32 bytes of pickle; reserved pages that
            // are never touched cost no resident memory, while growing by
            // doubling would briefly hold two copies of the events.
            events,
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
        if let (Action::Oom, Some(_)) = (ev.action, self.shape.device_free) {
            ev.addr = uint(self.shape.device_free)?;
        }
        Some(ev)
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

struct Reader<'d, 'a> {
    doc: &'d Document<'a>,
    stacks: StackReader,
    claimed: Vec<TraceEvent>,
}

impl<'d, 'a> Reader<'d, 'a> {
    fn new(doc: &'d Document<'a>) -> Self {
        Reader {
            doc,
            stacks: StackReader::default(),
            claimed: Vec::new(),
        }
    }

    fn field_err(&self, at: impl FnOnce() -> String, slot: Slot, want: &str) -> Error {
        field_err(self.doc, at, slot, want)
    }

    fn stack(&mut self, frames: Slot, at: impl FnOnce() -> String) -> Result<StackId> {
        self.stacks.stack(self.doc, frames, at)
    }

    fn uint(&self, slot: Slot, at: impl FnOnce() -> String) -> Result<u64> {
        match self.doc.as_i128(slot) {
            Some(v) if v >= 0 && v <= u64::MAX as i128 => Ok(v as u64),
            Some(v) => Err(Error::Field {
                at: at(),
                problem: format!("{v} is out of range"),
            }),
            None => Err(self.field_err(at, slot, "an integer")),
        }
    }

    fn list(&self, slot: Slot, at: impl FnOnce() -> String) -> Result<&'d [Slot]> {
        match self.doc.kind(slot) {
            Some(Kind::List | Kind::Tuple) => Ok(self.doc.seq(slot).unwrap_or(&[])),
            _ => Err(self.field_err(at, slot, "a list")),
        }
    }

    fn read(mut self) -> Result<Snapshot> {
        let doc = self.doc;
        let root = doc.root();
        let mut layout = Layout {
            protocol: doc.protocol(),
            ..Layout::default()
        };
        let (segments_slot, traces_slot) = match doc.kind(root) {
            Some(Kind::Dict) => {
                let seg = doc.dict_get(root, "segments").ok_or_else(|| {
                    Error::NotASnapshot("the top-level dict has no 'segments' key".into())
                })?;
                (seg, doc.dict_get(root, "device_traces"))
            }
            Some(Kind::List) => {
                layout.legacy_segment_list = true;
                (root, None)
            }
            _ => {
                return Err(Error::NotASnapshot(format!(
                    "the pickle holds a {}, not a dict or a list of segments",
                    type_name(doc, root)
                )))
            }
        };
        let seg_items = self.list(segments_slot, || "segments".into())?;
        let mut segments = Vec::with_capacity(seg_items.len());
        for (i, &s) in seg_items.iter().enumerate() {
            segments.push(self.segment(s, i, &mut layout)?);
        }
        let mut traces = Vec::new();
        if let Some(t) = traces_slot {
            let devs = self.list(t, || "device_traces".into())?;
            // Backwards, so that each device's claimed events are the tail of
            // the claimed list and move out of it without a copy.
            for (d, &dev) in devs.iter().enumerate().rev() {
                traces.push(self.trace(dev, d, &mut layout)?);
            }
            traces.reverse();
        }
        let allocator_settings = if layout.legacy_segment_list {
            None
        } else {
            doc.dict_get(root, "allocator_settings")
                .map(|s| to_json(doc, s, 16))
        };
        let annotations = match (
            layout.legacy_segment_list,
            doc.dict_get(root, "external_annotations"),
        ) {
            (false, Some(a)) => self.annotations(a)?,
            _ => Vec::new(),
        };
        Ok(Snapshot {
            segments,
            traces,
            allocator_settings,
            annotations,
            stacks: self.stacks.stacks,
            layout,
        })
    }

    fn segment(&mut self, s: Slot, i: usize, layout: &mut Layout) -> Result<Segment> {
        let doc = self.doc;
        let at = |f: &str| format!("segments[{i}].{f}");
        if doc.kind(s) != Some(Kind::Dict) {
            return Err(self.field_err(|| format!("segments[{i}]"), s, "a dict"));
        }
        let mut seg = Segment {
            device: 0,
            address: 0,
            total_size: 0,
            allocated_size: 0,
            active_size: 0,
            requested_size: 0,
            stream: 0,
            segment_type: String::new(),
            is_expandable: false,
            private_pool: false,
            blocks: Vec::new(),
        };
        let (mut allocated, mut active, mut requested) = (None, None, None);
        let mut blocks_slot = None;
        for (k, v) in doc.dict_items(s).into_iter().flatten() {
            match doc.str_bytes(k).unwrap_or(b"") {
                b"device" => seg.device = self.uint(v, || at("device"))? as i64,
                b"address" => seg.address = self.uint(v, || at("address"))?,
                b"total_size" => seg.total_size = self.uint(v, || at("total_size"))?,
                b"allocated_size" => allocated = Some(self.uint(v, || at("allocated_size"))?),
                b"active_size" => active = Some(self.uint(v, || at("active_size"))?),
                b"requested_size" => requested = Some(self.uint(v, || at("requested_size"))?),
                b"stream" => seg.stream = self.doc.as_i128(v).unwrap_or(0) as u64,
                b"segment_type" => seg.segment_type = doc.as_str(v).unwrap_or("").to_string(),
                b"is_expandable" => seg.is_expandable = doc.as_i64(v).unwrap_or(0) != 0,
                b"segment_pool_id" => {
                    seg.private_pool = doc
                        .seq(v)
                        .is_some_and(|ids| ids.iter().any(|&id| doc.as_i64(id).unwrap_or(0) != 0))
                }
                b"blocks" => blocks_slot = Some(v),
                _ => {}
            }
        }
        let blocks = match blocks_slot {
            Some(b) => self.list(b, || at("blocks"))?,
            None => &[],
        };
        let mut addr = seg.address;
        for (j, &b) in blocks.iter().enumerate() {
            let block = self.block(b, i, j, addr, layout)?;
            addr = block.address.saturating_add(block.size);
            seg.blocks.push(block);
        }
        let sum = |pred: fn(BlockState) -> bool, req: bool| -> u64 {
            seg.blocks
                .iter()
                .filter(|b| pred(b.state))
                .map(|b| if req { b.requested_size } else { b.size })
                .sum()
        };
        // torch 2.0 segments may lack the per-state totals; derive them.
        seg.allocated_size =
            allocated.unwrap_or_else(|| sum(|s| s == BlockState::ActiveAllocated, false));
        seg.active_size = active.unwrap_or_else(|| sum(BlockState::is_active, false));
        seg.requested_size = requested.unwrap_or_else(|| sum(BlockState::is_active, true));
        Ok(seg)
    }

    fn block(
        &mut self,
        b: Slot,
        i: usize,
        j: usize,
        next_addr: u64,
        layout: &mut Layout,
    ) -> Result<Block> {
        let doc = self.doc;
        let at = |f: &str| format!("segments[{i}].blocks[{j}].{f}");
        if doc.kind(b) != Some(Kind::Dict) {
            return Err(self.field_err(|| format!("segments[{i}].blocks[{j}]"), b, "a dict"));
        }
        let mut block = Block {
            address: next_addr,
            size: 0,
            requested_size: 0,
            state: BlockState::Unknown,
            stack: StackId::EMPTY,
        };
        let mut requested = None;
        let mut history = None;
        for (k, v) in doc.dict_items(b).into_iter().flatten() {
            match doc.str_bytes(k).unwrap_or(b"") {
                b"address" => block.address = self.uint(v, || at("address"))?,
                b"size" => block.size = self.uint(v, || at("size"))?,
                b"requested_size" => requested = Some(self.uint(v, || at("requested_size"))?),
                b"state" => {
                    block.state = match doc.str_bytes(v) {
                        Some(b"active_allocated") => BlockState::ActiveAllocated,
                        Some(b"active_pending_free") => BlockState::ActivePendingFree,
                        Some(b"inactive") => BlockState::Inactive,
                        _ => BlockState::Unknown,
                    }
                }
                b"frames" => block.stack = self.stack(v, || at("frames"))?,
                b"history" => history = Some(v),
                _ => {}
            }
        }
        if let Some(h) = history {
            // torch 2.0: the first history entry is the live allocation.
            layout.block_history = true;
            if let Some(&first) = self.list(h, || at("history"))?.first() {
                if requested.is_none() {
                    if let Some(r) = doc.dict_get(first, "real_size") {
                        requested = Some(self.uint(r, || at("history[0].real_size"))?);
                    }
                }
                if block.stack == StackId::EMPTY {
                    if let Some(f) = doc.dict_get(first, "frames") {
                        block.stack = self.stack(f, || at("history[0].frames"))?;
                    }
                }
            }
        }
        block.requested_size = requested.unwrap_or(block.size);
        Ok(block)
    }

    fn trace(&mut self, dev: Slot, d: usize, layout: &mut Layout) -> Result<DeviceTrace> {
        let doc = self.doc;
        let entries = self.list(dev, || format!("device_traces[{d}]"))?;
        if let Some(events) = self.claimed_tail(entries) {
            layout.trace_times |= events.iter().any(|e| e.time_us().is_some());
            return Ok(DeviceTrace {
                events,
                unknown_actions: BTreeMap::new(),
            });
        }
        let mut trace = DeviceTrace {
            events: Vec::with_capacity(entries.len()),
            unknown_actions: BTreeMap::new(),
        };
        let mut action_cache: HashMap<Slot, Action> = HashMap::new();
        for (i, &e) in entries.iter().enumerate() {
            if let Some(c) = doc.claimed(e) {
                let ev = self.claimed[c as usize];
                layout.trace_times |= ev.time_us().is_some();
                trace.events.push(ev);
                continue;
            }
            let at = |f: &str| format!("device_traces[{d}][{i}].{f}");
            if doc.kind(e) != Some(Kind::Dict) {
                return Err(self.field_err(|| format!("device_traces[{d}][{i}]"), e, "a dict"));
            }
            let mut ev = TraceEvent::BLANK;
            let mut action_slot = None;
            let mut device_free = None;
            for (k, v) in doc.dict_items(e).into_iter().flatten() {
                match EntryField::of(doc.str_bytes(k).unwrap_or(b"")) {
                    EntryField::Action => action_slot = Some(v),
                    EntryField::Addr => ev.addr = self.uint(v, || at("addr"))?,
                    EntryField::Size => ev.size = self.uint(v, || at("size"))?,
                    EntryField::TimeUs => ev.set_time(doc.as_i64(v)),
                    EntryField::Frames => ev.stack = self.stack(v, || at("frames"))?,
                    EntryField::DeviceFree => {
                        device_free = Some(self.uint(v, || at("device_free"))?)
                    }
                    EntryField::Other => {}
                }
            }
            let Some(a) = action_slot else {
                return Err(Error::Field {
                    at: format!("device_traces[{d}][{i}]"),
                    problem: "entry has no 'action'".into(),
                });
            };
            ev.action = match action_cache.get(&a) {
                Some(&x) => x,
                None => {
                    let bytes = doc
                        .str_bytes(a)
                        .ok_or_else(|| self.field_err(|| at("action"), a, "a str"))?;
                    let x = Action::parse(bytes);
                    action_cache.insert(a, x);
                    x
                }
            };
            if ev.action == Action::Unknown {
                let name = doc.as_str(a).unwrap_or("?").to_string();
                *trace.unknown_actions.entry(name).or_default() += 1;
            }
            if ev.action == Action::Oom {
                // Newer writers name the driver's free bytes explicitly.
                if let Some(free) = device_free {
                    ev.addr = free;
                }
            }
            layout.trace_times |= ev.time_us().is_some();
            trace.events.push(ev);
        }
        Ok(trace)
    }

    /// Moves out the claimed events when `entries` are exactly the last ones claimed, in order.
    fn claimed_tail(&mut self, entries: &[Slot]) -> Option<Vec<TraceEvent>> {
        let first = self.doc.claimed(*entries.first()?)? as usize;
        if first + entries.len() != self.claimed.len() {
            return None;
        }
        let in_order = entries
            .iter()
            .enumerate()
            .all(|(i, &e)| self.doc.claimed(e) == Some((first + i) as u32));
        if !in_order {
            return None;
        }
        Some(if first == 0 {
            std::mem::take(&mut self.claimed)
        } else {
            self.claimed.split_off(first)
        })
    }

    fn annotations(&mut self, a: Slot) -> Result<Vec<Annotation>> {
        let doc = self.doc;
        let mut out = Vec::new();
        for &e in self.list(a, || "external_annotations".into())? {
            let get = |k: &str| doc.dict_get(e, k);
            let name = get("name")
                .and_then(|s| doc.as_str(s))
                .unwrap_or("")
                .to_string();
            // A range boundary of a kind this reader does not know cannot be
            // paired; skipping it loses one phase, not the whole analysis.
            let stage = match get("stage").and_then(|s| doc.as_str(s)) {
                Some("START") => Stage::Start,
                Some("END") => Stage::End,
                _ => continue,
            };
            let device = get("device").and_then(|s| doc.as_i64(s)).unwrap_or(0);
            let Some(time_us) = get("time_us").and_then(|s| doc.as_i64(s)) else {
                continue;
            };
            out.push(Annotation {
                name,
                stage,
                device,
                time_us,
            });
        }
        Ok(out)
    }
}

/// Values [`to_json`] converts at most: far more than the allocator settings
/// and annotations it is used for hold, and few enough that a small file
/// whose containers share each other many times over (a tree of memo
/// references expands exponentially) cannot make oomkit build a huge value.
pub const TO_JSON_MAX_VALUES: usize = 100_000;

/// Converts a pickled value to JSON, bounded in depth so cycles cannot loop
/// and in size ([`TO_JSON_MAX_VALUES`]); what lies past either is null.
pub fn to_json(doc: &Document<'_>, slot: Slot, depth: usize) -> serde_json::Value {
    let mut left = TO_JSON_MAX_VALUES;
    to_json_within(doc, slot, depth, &mut left)
}

fn to_json_within(
    doc: &Document<'_>,
    slot: Slot,
    depth: usize,
    left: &mut usize,
) -> serde_json::Value {
    use serde_json::Value as J;
    if *left == 0 {
        return J::Null;
    }
    *left -= 1;
    match doc.value(slot) {
        Value::None => J::Null,
        Value::Bool(b) => J::Bool(b),
        Value::Int(v) => J::from(v),
        Value::BigInt(_) => doc
            .as_i128(slot)
            .map(|v| J::String(v.to_string()))
            .unwrap_or(J::Null),
        Value::Float(f) => serde_json::Number::from_f64(f)
            .map(J::Number)
            .unwrap_or(J::Null),
        Value::Str(s) => J::String(s.to_string()),
        Value::Bytes(_) | Value::ByteArray(_) => J::Null,
        Value::Container(_) if depth == 0 => J::Null,
        Value::Container(Kind::Dict) => {
            let mut m = serde_json::Map::new();
            for (k, v) in doc.dict_items(slot).into_iter().flatten() {
                if *left == 0 {
                    break;
                }
                let key = match doc.value(k) {
                    Value::Str(s) => s.to_string(),
                    _ => doc.repr(k, 4),
                };
                m.insert(key, to_json_within(doc, v, depth - 1, left));
            }
            J::Object(m)
        }
        Value::Container(_) => {
            let mut items = Vec::new();
            for &s in doc.seq(slot).unwrap_or(&[]) {
                if *left == 0 {
                    break;
                }
                items.push(to_json_within(doc, s, depth - 1, left));
            }
            J::Array(items)
        }
    }
}

impl Snapshot {
    /// Reads a snapshot file through a memory map, calling `progress` with
    /// bytes read and total bytes as parsing advances.
    ///
    /// Pages behind the parser are handed back to the kernel as it goes, so
    /// resident memory tracks what is being built, not the file's size.
    pub fn load(
        path: &std::path::Path,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Snapshot> {
        let src = oomkit_pickle::Source::open(path)?;
        let bytes = src.bytes();
        let total = bytes.len();
        let snap = src.paged(|pager| {
            Self::read_streaming(bytes, &mut |pos, ahead| {
                pager.advanced(pos, ahead);
                progress(pos, total);
            })
        });
        src.release(0, total);
        snap
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_of_shared_containers_is_bounded() {
        // A list holding the one below ten times, twelve levels deep: 10^12
        // leaves in a few hundred bytes of pickle.
        let mut p = b"\x80\x02]q\x000".to_vec();
        for i in 1..=12u8 {
            p.extend([b']', b'q', i, b'(']);
            p.extend((0..10).flat_map(|_| [b'h', i - 1]));
            p.extend(if i < 12 { &b"e0"[..] } else { &b"e"[..] });
        }
        p.push(b'.');
        let doc = Document::parse(&p).unwrap();
        fn count(v: &serde_json::Value) -> usize {
            1 + match v {
                serde_json::Value::Array(a) => a.iter().map(count).sum(),
                serde_json::Value::Object(m) => m.values().map(count).sum(),
                _ => 0,
            }
        }
        let n = count(&to_json(&doc, doc.root(), 16));
        assert!(n <= TO_JSON_MAX_VALUES, "{n}");
    }
}
