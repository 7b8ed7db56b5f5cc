//! Reading the typed snapshot from a parsed pickle, for every layout from
//! torch 2.0 to today: segments, blocks, per-device traces, annotations and
//! the interned stacks, each field checked and named when it is not what a
//! snapshot holds.

use crate::claim::{EntryClaim, EntryField};
use crate::dump::to_json;
use crate::error::{Error, Result};
use crate::model::*;
use crate::slots::{field_err, type_name};
use crate::stack_reader::StackReader;
use crate::stacks::StackId;
use oomkit_pickle::{Document, Kind, Slot};
use std::collections::{BTreeMap, HashMap};

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
            interned: claim.interned,
        }
        .read()
    }

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

struct Reader<'d, 'a> {
    doc: &'d Document<'a>,
    stacks: StackReader,
    claimed: Vec<TraceEvent>,
    interned: Interned,
}

impl<'d, 'a> Reader<'d, 'a> {
    fn new(doc: &'d Document<'a>) -> Self {
        Reader {
            doc,
            stacks: StackReader::default(),
            claimed: Vec::new(),
            interned: Interned::default(),
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
            stacks: self.stacks.into_stacks(),
            layout,
            streams: self.interned.streams,
            pools: self.interned.pools,
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
            pool: 0,
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
                b"stream" => {
                    seg.stream = self.doc.as_i128(v).unwrap_or(0) as u64;
                    self.interned.stream(seg.stream as i64);
                }
                b"segment_type" => seg.segment_type = doc.as_str(v).unwrap_or("").to_string(),
                b"is_expandable" => seg.is_expandable = doc.as_i64(v).unwrap_or(0) != 0,
                b"segment_pool_id" => {
                    seg.private_pool = doc
                        .seq(v)
                        .is_some_and(|ids| ids.iter().any(|&id| doc.as_i64(id).unwrap_or(0) != 0));
                    if let Some(id) = crate::claim::pool_id(doc, v) {
                        seg.pool = self.interned.pool(id);
                    }
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
                    EntryField::Stream => {
                        ev.stream = self.interned.stream(doc.as_i64(v).unwrap_or(0));
                    }
                    EntryField::Pool => {
                        if let Some(id) = crate::claim::pool_id(doc, v) {
                            ev.pool = self.interned.pool(id);
                        }
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
