//! The pickle virtual machine: opcodes in, arena out, nothing executed.

use crate::error::{Error, Result};
use crate::pager::Ahead;
use crate::value::*;
use std::collections::HashMap;

mod fast;

/// Bounds that keep hostile input from exhausting memory.
///
/// The parser never recurses, so the native stack is safe whatever the input;
/// these limits cap what it allocates.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Most unfinished `MARK`s at once, that is, nesting of containers under construction.
    pub max_marks: usize,
    /// Most values on the machine's stack at once.
    pub max_stack: usize,
    /// Most arena cells (container items, containers, stack entries) in all,
    /// at most 2^32.
    /// `None` means four per input byte plus 16 Mi, far above what real
    /// snapshots use (under one per eight bytes) yet small enough that a
    /// crafted file cannot blow up by more than a small constant factor.
    pub max_cells: Option<usize>,
    /// Deepest nesting that [`crate::Document::repr`] will walk.
    pub max_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_marks: 10_000,
            max_stack: 1 << 24,
            max_cells: None,
            max_depth: 1_000,
        }
    }
}

/// How often, in input bytes, the progress callback is called.
const PROGRESS_STEP: usize = 1 << 20;
/// How much of the memo's spare capacity one progress step names as about to be filled.
const MEMO_AHEAD: usize = 1 << 20;
/// Gap beyond which an explicit memo index goes to the sparse map instead of the vector.
const MEMO_DENSE_GAP: usize = 1 << 16;

/// Names of opcodes that would run or build Python code, with what they would do.
fn refused(op: u8) -> Option<(&'static str, &'static str)> {
    Some(match op {
        b'c' => ("GLOBAL", "imports a Python object by name"),
        0x93 => ("STACK_GLOBAL", "imports a Python object by name"),
        b'R' => ("REDUCE", "calls a Python object"),
        b'b' => ("BUILD", "sets the state of a Python object"),
        b'i' => ("INST", "creates an instance of a class"),
        b'o' => ("OBJ", "creates an instance of a class"),
        0x81 => ("NEWOBJ", "creates an instance of a class"),
        0x92 => ("NEWOBJ_EX", "creates an instance of a class"),
        b'P' => ("PERSID", "asks the loader for an external object"),
        b'Q' => ("BINPERSID", "asks the loader for an external object"),
        0x82 => ("EXT1", "imports an object from the extension registry"),
        0x83 => ("EXT2", "imports an object from the extension registry"),
        0x84 => ("EXT4", "imports an object from the extension registry"),
        0x97 => ("NEXT_BUFFER", "refers to an out-of-band buffer"),
        0x98 => ("READONLY_BUFFER", "wraps an out-of-band buffer"),
        _ => return None,
    })
}

/// Takes selected dicts over while they are parsed, so they never stay in the arena.
///
/// Most of a snapshot is small dicts of one shape (trace entries). A caller
/// that turns each into a compact record of its own as soon as the dict is
/// complete keeps peak memory near the size of those records instead of the
/// generic tree plus the records.
///
/// The parser consults the claim when a dict that was empty receives a
/// single `SETITEMS` batch of fewer than 1,000 pairs: CPython's pickler
/// writes every such dict in one batch, so the dict is complete. The claim
/// sees the dict's items, key and value alternating; the dict itself may
/// not have them in the document. A claimed
/// dict keeps its identity (memo references still reach it) but reads as
/// empty; [`Document::claimed`] returns the number the claim gave it. A
/// pickle that adds items to a claimed dict later is refused as malformed.
///
/// Lists of memo references inside such dicts (the frames of a trace
/// entry, which are most of a real snapshot's bytes) are offered too, to
/// [`Claim::claim_list`], as soon as they are complete; a claimed list reads
/// as empty and [`Document::claimed_list`] returns its number.
pub trait Claim {
    /// Returns a record number to take over the dict of `items` (key, value,
    /// key, value, ...), or `None` to leave it in the document.
    fn claim(&mut self, doc: &Document<'_>, items: &[Slot]) -> Option<u32>;

    /// Returns a number to take over a non-empty list of `items` found in a
    /// dict on the fast path, or `None` (the default) to leave it in the document.
    ///
    /// The answer must depend on the items' slots alone: the parser gives a
    /// later list that holds exactly the slots of a claimed one the same
    /// number without asking again.
    fn claim_list(&mut self, _doc: &Document<'_>, _items: &[Slot]) -> Option<u32> {
        None
    }

    /// Names the claim's own tables that the next megabyte of input will
    /// fill, so that a [`crate::Pager`] can fault them in first.
    fn ahead(&self, _ahead: &mut Ahead) {}
}

/// Batch size of CPython's pickler: a dict batch this large may be followed by more.
const PICKLER_BATCH: usize = 1000;

struct Machine<'a, 'p> {
    doc: Document<'a>,
    pos: usize,
    op_at: usize,
    stack: Vec<Slot>,
    marks: Vec<usize>,
    memo: Vec<Slot>,
    sparse_memo: HashMap<u64, Slot>,
    /// Changes whenever a memo cell that existed is replaced, so that what
    /// was learned from memo references can be known to still hold.
    memo_epoch: u64,
    lists: fast::ListCache,
    cells: usize,
    max_cells: usize,
    limits: &'p Limits,
    claim: Option<&'p mut dyn Claim>,
}

impl Document<'_> {
    /// Parses a whole pickle with the default [`Limits`].
    pub fn parse(data: &[u8]) -> Result<Document<'_>> {
        Self::parse_with(data, &Limits::default(), &mut |_, _| {})
    }

    /// Parses a pickle with explicit limits, calling `progress` every
    /// megabyte with the number of bytes read and the tables about to grow
    /// (for a [`crate::Pager`]).
    pub fn parse_with<'a>(
        data: &'a [u8],
        limits: &Limits,
        progress: &mut dyn FnMut(usize, &Ahead),
    ) -> Result<Document<'a>> {
        Self::parse_inner(data, limits, progress, None)
    }

    /// Parses a pickle like [`Document::parse_with`], letting `claim` take
    /// complete dicts over as they are read.
    pub fn parse_claiming<'a, 'p>(
        data: &'a [u8],
        limits: &'p Limits,
        progress: &mut dyn FnMut(usize, &Ahead),
        claim: &'p mut dyn Claim,
    ) -> Result<Document<'a>> {
        Self::parse_inner(data, limits, progress, Some(claim))
    }

    fn parse_inner<'a, 'p>(
        data: &'a [u8],
        limits: &'p Limits,
        progress: &mut dyn FnMut(usize, &Ahead),
        claim: Option<&'p mut dyn Claim>,
    ) -> Result<Document<'a>> {
        let max_cells = limits
            .max_cells
            .unwrap_or_else(|| data.len().saturating_mul(4).saturating_add(16 << 20))
            // Containers index the slab with 32 bits.
            .min(u32::MAX as usize);
        // Real snapshots need about one slab cell per five input bytes, a
        // container and a string per eighty, and a memo cell per fifty (a
        // trace entry memoizes its dict, its frames list and a fresh string
        // in about 150 bytes); reserving that up front avoids growing by
        // doubling, which would briefly hold two copies of the largest tables
        // and copy them into memory that the pager has not faulted in.
        // Untouched reserved pages cost no resident memory.
        let mut m = Machine {
            doc: Document {
                data,
                spans: Vec::with_capacity(data.len() / 64),
                floats: Vec::new(),
                containers: Vec::with_capacity(data.len() / 64),
                slab: Vec::with_capacity(data.len() / 4),
                own: Vec::new(),
                root: Slot::NONE,
                protocol: 0,
            },
            pos: 0,
            op_at: 0,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Vec::with_capacity(data.len() / 32),
            sparse_memo: HashMap::new(),
            memo_epoch: 0,
            lists: fast::ListCache::default(),
            cells: 0,
            max_cells,
            limits,
            claim,
        };
        crate::advise_huge_pages(&m.doc.slab);
        crate::advise_huge_pages(&m.memo);
        crate::advise_huge_pages(&m.doc.containers);
        crate::advise_huge_pages(&m.doc.spans);
        m.run(progress)?;
        Ok(m.doc)
    }
}

impl<'a> Machine<'a, '_> {
    fn truncated(&self, what: &str) -> Error {
        Error::Truncated {
            offset: self.doc.data.len() as u64,
            what: format!("{what} (opcode at byte {})", self.op_at),
        }
    }

    fn malformed(&self, reason: impl Into<String>) -> Error {
        Error::Malformed {
            offset: self.op_at as u64,
            reason: reason.into(),
        }
    }

    #[inline]
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let data = self.doc.data;
        if data.len() - self.pos < n {
            return Err(self.truncated(&format!("{what} needs {n} bytes")));
        }
        let s = &data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline]
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    #[inline]
    fn u16(&mut self, what: &str) -> Result<u16> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    #[inline]
    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    #[inline]
    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    #[inline]
    fn length(&mut self, n: u64, what: &str) -> Result<usize> {
        let left = (self.doc.data.len() - self.pos) as u64;
        if n > left {
            return Err(self.truncated(&format!("{what} of {n} bytes")));
        }
        Ok(n as usize)
    }

    #[inline]
    fn charge(&mut self, cells: usize) -> Result<()> {
        self.cells += cells;
        if self.cells > self.max_cells {
            return Err(Error::Limit {
                offset: self.op_at as u64,
                what: format!("more than {} arena cells", self.max_cells),
            });
        }
        Ok(())
    }

    #[inline]
    fn push(&mut self, s: Slot) -> Result<()> {
        if self.stack.len() >= self.limits.max_stack {
            return Err(Error::Limit {
                offset: self.op_at as u64,
                what: format!("stack deeper than {}", self.limits.max_stack),
            });
        }
        self.stack.push(s);
        Ok(())
    }

    /// Index of the first stack entry above the innermost mark.
    #[inline]
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    #[inline]
    fn pop(&mut self) -> Result<Slot> {
        if self.stack.len() <= self.floor() {
            return Err(self.malformed("stack underflow"));
        }
        Ok(self.stack.pop().expect("checked above"))
    }

    #[inline]
    fn top(&self) -> Result<Slot> {
        if self.stack.len() <= self.floor() {
            return Err(self.malformed("stack underflow"));
        }
        Ok(*self.stack.last().expect("checked above"))
    }

    fn pop_mark(&mut self) -> Result<usize> {
        self.marks
            .pop()
            .ok_or_else(|| self.malformed("no MARK before this opcode"))
    }

    #[inline]
    fn new_span(&mut self, tag: u64, bytes: &'a [u8]) -> Result<()> {
        let off = bytes.as_ptr() as usize - self.doc.data.as_ptr() as usize;
        let slot = Slot::short_span(tag, off, bytes.len()).unwrap_or_else(|| {
            self.doc.spans.push(Span {
                off,
                len: bytes.len(),
            });
            Slot::tagged(tag, self.doc.spans.len() - 1)
        });
        self.push(slot)
    }

    #[inline]
    fn new_str(&mut self, bytes: &'a [u8]) -> Result<()> {
        if std::str::from_utf8(bytes).is_err() {
            return Err(self.malformed("string is not valid UTF-8"));
        }
        self.new_span(T_STR, bytes)
    }

    #[inline]
    fn new_int_bytes(&mut self, bytes: &'a [u8]) -> Result<()> {
        // Addresses and times are 5 to 8 bytes wide; sign-extend them directly.
        if (1..8).contains(&bytes.len()) {
            let v = sign_extend(bytes);
            if (INLINE_MIN..=INLINE_MAX).contains(&v) {
                return self.push(Slot::int(v));
            }
        }
        match bigint_to_i128(bytes) {
            Some(v) if (INLINE_MIN as i128..=INLINE_MAX as i128).contains(&v) => {
                self.push(Slot::int(v as i64))
            }
            _ => self.new_span(T_BIGINT, bytes),
        }
    }

    fn new_container(&mut self, kind: Kind, items: Option<usize>) -> Result<Slot> {
        self.charge(2)?;
        let id = self.doc.containers.len();
        self.doc.containers.push(Container::new(kind));
        let slot = Slot::tagged(T_CONT, id);
        if let Some(from) = items {
            self.extend_from_stack(slot, from)?;
        }
        Ok(slot)
    }

    /// Moves `stack[from..]` into the container, keeping the items contiguous.
    fn extend_from_stack(&mut self, target: Slot, from: usize) -> Result<()> {
        let n = self.stack.len() - from;
        if n == 0 {
            return Ok(());
        }
        self.charge(n)?;
        let doc = &mut self.doc;
        let c = &mut doc.containers[target.index()];
        let items = &self.stack[from..];
        match c.place() {
            Place::Claimed(_) => {
                return Err(Error::Malformed {
                    offset: self.op_at as u64,
                    reason: "items added to a dict after it was complete".into(),
                })
            }
            Place::Own(i) => doc.own[i].extend_from_slice(items),
            Place::Slab { start, len }
                if (len == 0 || start + len == doc.slab.len()) && len + n <= SLAB_MAX_LEN =>
            {
                let start = if len == 0 { doc.slab.len() } else { start };
                doc.slab.extend_from_slice(items);
                c.set_slab(start, len + n);
            }
            Place::Slab { start, len } => {
                // Another container was filled after this one, or it outgrew
                // the slab's length field: give it a vector of its own. Only
                // containers filled in several batches (large lists and
                // dicts) ever get here.
                let old = &doc.slab[start..start + len];
                let mut v = Vec::with_capacity(old.len() + items.len());
                v.extend_from_slice(old);
                v.extend_from_slice(items);
                c.set_own(doc.own.len());
                doc.own.push(v);
            }
        }
        self.stack.truncate(from);
        Ok(())
    }

    /// Checks that `target` is a container of one of `kinds`.
    fn expect_kind(&self, target: Slot, kinds: &[Kind], op: &str) -> Result<()> {
        if let Some((kind, _)) = target.claimed_id() {
            let kind = if kind == Kind::Dict { "dict" } else { "list" };
            return Err(self.malformed(format!("items added to a {kind} after it was complete")));
        }
        match self.doc.kind(target) {
            Some(k) if kinds.contains(&k) => Ok(()),
            Some(k) => Err(self.malformed(format!("{op} applied to a {k:?}"))),
            None => Err(self.malformed(format!("{op} applied to a non-container"))),
        }
    }

    /// Lets the claim take a dict whose items were just appended at the slab's end.
    fn offer(&mut self, dict: Slot) {
        let Some(claim) = self.claim.as_mut() else {
            return;
        };
        let Place::Slab { start, len } = self.doc.containers[dict.index()].place() else {
            return;
        };
        if start + len != self.doc.slab.len() {
            return;
        }
        let Some(id) = claim.claim(&self.doc, &self.doc.slab[start..]) else {
            return;
        };
        self.doc.slab.truncate(start);
        self.cells -= len;
        self.doc.containers[dict.index()].set_claimed(id);
    }

    fn memo_put(&mut self, idx: u64) -> Result<()> {
        let top = self.top()?;
        let i = idx as usize;
        if i < self.memo.len() {
            self.memo[i] = top;
            self.memo_epoch += 1;
        } else if (i as u64) == idx && i - self.memo.len() <= MEMO_DENSE_GAP {
            self.charge(i + 1 - self.memo.len())?;
            self.memo.resize(i, Slot::EMPTY);
            self.memo.push(top);
        } else {
            self.charge(2)?;
            self.sparse_memo.insert(idx, top);
        }
        Ok(())
    }

    #[inline]
    fn memo_get(&mut self, idx: u64) -> Result<()> {
        let found = usize::try_from(idx)
            .ok()
            .and_then(|i| self.memo.get(i).copied())
            .filter(|s| *s != Slot::EMPTY)
            .or_else(|| self.sparse_memo.get(&idx).copied());
        match found {
            Some(s) => {
                self.charge(1)?;
                self.push(s)
            }
            None => Err(self.malformed(format!("memo key {idx} was never stored"))),
        }
    }

    /// The stack machine: one loop over the opcodes, one arm each.
    ///
    /// Long on purpose: it is the reader's hot loop (a gigabyte snapshot is
    /// hundreds of millions of opcodes), whose arms share the stack, the memo
    /// and the position, and one match over the opcode keeps the dispatch in
    /// one place; each arm is a few lines that read on their own.
    fn run(&mut self, progress: &mut dyn FnMut(usize, &Ahead)) -> Result<()> {
        let data = self.doc.data;
        let mut next_progress = PROGRESS_STEP;
        loop {
            if self.pos >= next_progress {
                let mut ahead = Ahead::default();
                ahead.add(&self.memo, MEMO_AHEAD);
                if let Some(claim) = &self.claim {
                    claim.ahead(&mut ahead);
                }
                progress(self.pos, &ahead);
                next_progress = self.pos + PROGRESS_STEP;
            }
            self.op_at = self.pos;
            let Some(&op) = data.get(self.pos) else {
                return Err(self.truncated("the pickle ends without a STOP opcode"));
            };
            self.pos += 1;
            match op {
                0x80 => {
                    let v = self.u8("PROTO")?;
                    if v > 5 {
                        return Err(self.malformed(format!("unsupported pickle protocol {v}")));
                    }
                    self.doc.protocol = v;
                }
                0x95 => {
                    let n = self.u64("FRAME")?;
                    self.length(n, "FRAME")?;
                }
                b'.' => {
                    let root = self.pop()?;
                    self.doc.root = root;
                    progress(self.pos, &Ahead::default());
                    return Ok(());
                }
                b'(' => {
                    if self.marks.len() >= self.limits.max_marks {
                        return Err(Error::Limit {
                            offset: self.op_at as u64,
                            what: format!("nesting deeper than {} MARKs", self.limits.max_marks),
                        });
                    }
                    self.marks.push(self.stack.len());
                }
                b'0' => {
                    if self.stack.len() > self.floor() {
                        self.stack.pop();
                    } else if self.marks.last() == Some(&self.stack.len()) && !self.marks.is_empty()
                    {
                        self.marks.pop();
                    } else {
                        return Err(self.malformed("POP on an empty stack"));
                    }
                }
                b'1' => {
                    let m = self.pop_mark()?;
                    self.stack.truncate(m);
                }
                b'2' => {
                    let t = self.top()?;
                    self.charge(1)?;
                    self.push(t)?;
                }
                b'N' => self.push(Slot::NONE)?,
                0x88 => self.push(Slot::TRUE)?,
                0x89 => self.push(Slot::FALSE)?,
                b'J' => {
                    let v = self.u32("BININT")? as i32;
                    self.push(Slot::int(v as i64))?;
                }
                b'K' => {
                    let v = self.u8("BININT1")?;
                    self.push(Slot::int(v as i64))?;
                }
                b'M' => {
                    let v = self.u16("BININT2")?;
                    self.push(Slot::int(v as i64))?;
                }
                0x8a => {
                    let n = self.u8("LONG1")? as u64;
                    let n = self.length(n, "LONG1")?;
                    let b = self.take(n, "LONG1")?;
                    self.new_int_bytes(b)?;
                }
                0x8b => {
                    let n = self.u32("LONG4")? as i32;
                    if n < 0 {
                        return Err(self.malformed("LONG4 with a negative length"));
                    }
                    let n = self.length(n as u64, "LONG4")?;
                    let b = self.take(n, "LONG4")?;
                    self.new_int_bytes(b)?;
                }
                b'G' => {
                    let b = self.take(8, "BINFLOAT")?;
                    let v = f64::from_be_bytes(b.try_into().expect("8 bytes"));
                    self.doc.floats.push(v);
                    let idx = self.doc.floats.len() - 1;
                    self.push(Slot::tagged(T_FLOAT, idx))?;
                }
                0x8c => {
                    let n = self.u8("SHORT_BINUNICODE")? as usize;
                    let b = self.take(n, "SHORT_BINUNICODE")?;
                    self.new_str(b)?;
                }
                b'X' => {
                    let n = self.u32("BINUNICODE")? as u64;
                    let n = self.length(n, "BINUNICODE")?;
                    let b = self.take(n, "BINUNICODE")?;
                    self.new_str(b)?;
                }
                0x8d => {
                    let n = self.u64("BINUNICODE8")?;
                    let n = self.length(n, "BINUNICODE8")?;
                    let b = self.take(n, "BINUNICODE8")?;
                    self.new_str(b)?;
                }
                b'C' => {
                    let n = self.u8("SHORT_BINBYTES")? as usize;
                    let b = self.take(n, "SHORT_BINBYTES")?;
                    self.new_span(T_BYTES, b)?;
                }
                b'B' => {
                    let n = self.u32("BINBYTES")? as u64;
                    let n = self.length(n, "BINBYTES")?;
                    let b = self.take(n, "BINBYTES")?;
                    self.new_span(T_BYTES, b)?;
                }
                0x8e => {
                    let n = self.u64("BINBYTES8")?;
                    let n = self.length(n, "BINBYTES8")?;
                    let b = self.take(n, "BINBYTES8")?;
                    self.new_span(T_BYTES, b)?;
                }
                0x96 => {
                    let n = self.u64("BYTEARRAY8")?;
                    let n = self.length(n, "BYTEARRAY8")?;
                    let b = self.take(n, "BYTEARRAY8")?;
                    self.new_span(T_BYTEARRAY, b)?;
                }
                b'}' => {
                    if self.claim.is_some() && self.fast_dict() {
                        continue;
                    }
                    let s = self.new_container(Kind::Dict, None)?;
                    self.push(s)?;
                }
                b']' => {
                    let s = self.new_container(Kind::List, None)?;
                    self.push(s)?;
                }
                b')' => {
                    let s = self.new_container(Kind::Tuple, None)?;
                    self.push(s)?;
                }
                0x8f => {
                    let s = self.new_container(Kind::Set, None)?;
                    self.push(s)?;
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < self.floor() + n {
                        return Err(self.malformed("stack underflow"));
                    }
                    let from = self.stack.len() - n;
                    let s = self.new_container(Kind::Tuple, Some(from))?;
                    self.push(s)?;
                }
                b't' | b'l' | b'd' | 0x91 => {
                    let from = self.pop_mark()?;
                    let kind = match op {
                        b't' => Kind::Tuple,
                        b'l' => Kind::List,
                        b'd' => Kind::Dict,
                        _ => Kind::FrozenSet,
                    };
                    if kind == Kind::Dict && !(self.stack.len() - from).is_multiple_of(2) {
                        return Err(self.malformed("DICT with an odd number of items"));
                    }
                    let s = self.new_container(kind, Some(from))?;
                    self.push(s)?;
                }
                b'a' => {
                    if self.stack.len() < self.floor() + 2 {
                        return Err(self.malformed("stack underflow"));
                    }
                    let from = self.stack.len() - 1;
                    let target = self.stack[from - 1];
                    self.expect_kind(target, &[Kind::List], "APPEND")?;
                    self.extend_from_stack(target, from)?;
                }
                b'e' | 0x90 => {
                    let from = self.pop_mark()?;
                    if from == 0 || from <= self.floor() {
                        return Err(self.malformed("stack underflow"));
                    }
                    let target = self.stack[from - 1];
                    if op == b'e' {
                        self.expect_kind(target, &[Kind::List], "APPENDS")?;
                    } else {
                        self.expect_kind(target, &[Kind::Set], "ADDITEMS")?;
                    }
                    self.extend_from_stack(target, from)?;
                }
                b's' => {
                    if self.stack.len() < self.floor() + 3 {
                        return Err(self.malformed("stack underflow"));
                    }
                    let from = self.stack.len() - 2;
                    let target = self.stack[from - 1];
                    self.expect_kind(target, &[Kind::Dict], "SETITEM")?;
                    self.extend_from_stack(target, from)?;
                }
                b'u' => {
                    let from = self.pop_mark()?;
                    if from == 0 || from <= self.floor() {
                        return Err(self.malformed("stack underflow"));
                    }
                    let target = self.stack[from - 1];
                    self.expect_kind(target, &[Kind::Dict], "SETITEMS")?;
                    let n = self.stack.len() - from;
                    if !n.is_multiple_of(2) {
                        return Err(self.malformed("SETITEMS with an odd number of items"));
                    }
                    let was_empty = self.doc.containers[target.index()].place()
                        == (Place::Slab { start: 0, len: 0 });
                    self.extend_from_stack(target, from)?;
                    if was_empty && n > 0 && n / 2 < PICKLER_BATCH {
                        self.offer(target);
                    }
                }
                0x94 => {
                    let idx = self.memo.len() as u64;
                    self.memo_put(idx)?;
                }
                b'q' => {
                    let i = self.u8("BINPUT")? as u64;
                    self.memo_put(i)?;
                }
                b'r' => {
                    let i = self.u32("LONG_BINPUT")? as u64;
                    self.memo_put(i)?;
                }
                b'h' => {
                    let i = self.u8("BINGET")? as u64;
                    self.memo_get(i)?;
                }
                b'j' => {
                    let i = self.u32("LONG_BINGET")? as u64;
                    self.memo_get(i)?;
                }
                b'p' | b'g' => {
                    let rest = &data[self.pos..];
                    let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
                        return Err(self.truncated("PUT/GET needs a decimal line"));
                    };
                    let idx = std::str::from_utf8(&rest[..nl])
                        .ok()
                        .and_then(|s| s.trim().parse::<u64>().ok())
                        .ok_or_else(|| self.malformed("PUT/GET index is not a number"))?;
                    self.pos += nl + 1;
                    if op == b'p' {
                        self.memo_put(idx)?;
                    } else {
                        self.memo_get(idx)?;
                    }
                }
                _ => {
                    if let Some((name, why)) = refused(op) {
                        return Err(Error::Refused {
                            name,
                            offset: self.op_at as u64,
                            why,
                        });
                    }
                    return Err(Error::UnknownOpcode {
                        byte: op,
                        offset: self.op_at as u64,
                    });
                }
            }
        }
    }
}

/// Reads a little-endian two's-complement integer of 1 to 8 bytes.
///
/// Built in a register rather than by copying the bytes into a stack buffer
/// and reading it back, which took a `memcpy` call for every address and
/// time of a trace.
#[inline(always)]
fn sign_extend(bytes: &[u8]) -> i64 {
    debug_assert!((1..=8).contains(&bytes.len()));
    let raw = bytes
        .iter()
        .rev()
        .fold(0u64, |acc, &b| (acc << 8) | b as u64);
    let unused = 64 - 8 * bytes.len() as u32;
    ((raw << unused) as i64) >> unused
}
