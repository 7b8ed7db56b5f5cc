//! A fast path for the flat dicts that a [`Claim`] takes over.
//!
//! Trace entries are most of a snapshot. Each is a short dict whose keys are
//! memo references and whose values are small integers, short strings, memo
//! references and at most a list of memo references (the frames). The
//! generic machine spends a dispatch, a stack push and several checks on
//! each of their twenty-odd opcodes; this path reads the same opcodes in one
//! loop and hands the items to the claim without building the dict.
//!
//! It either reads the whole dict up to its `SETITEMS` or leaves the machine
//! exactly as it was, so anything it does not expect (a nested dict, an
//! explicit memo index, a wide integer, malformed or truncated input) goes
//! to the generic machine, which reads or reports it in full.

use super::*;

/// Most items, keys and values together, that a dict read here may hold.
const FAST_MAX_ITEMS: usize = 64;

/// Lengths of the tables that the fast path appends to, for undoing it.
struct Saved {
    containers: usize,
    slab: usize,
    spans: usize,
    memo: usize,
}

impl Machine<'_, '_> {
    /// Reads the dict whose `EMPTY_DICT` was just consumed, if it is flat; returns whether it did.
    pub(super) fn fast_dict(&mut self) -> bool {
        let saved = Saved {
            containers: self.doc.containers.len(),
            slab: self.doc.slab.len(),
            spans: self.doc.spans.len(),
            memo: self.memo.len(),
        };
        match self.try_fast_dict() {
            Some(end) => {
                self.pos = end;
                self.lists.commit();
                true
            }
            None => {
                self.doc.containers.truncate(saved.containers);
                self.doc.slab.truncate(saved.slab);
                self.doc.spans.truncate(saved.spans);
                self.memo.truncate(saved.memo);
                // The generic machine will fill those memo cells again,
                // perhaps with other slots, so what was learned about list
                // bodies read since the dict began is forgotten.
                self.lists.discard();
                false
            }
        }
    }

    #[inline(always)]
    fn dense_memo(&self, i: usize) -> Option<Slot> {
        self.memo.get(i).copied().filter(|s| *s != Slot::EMPTY)
    }

    /// Reads a memo reference at `p`, returning the slot and the next position.
    #[inline(always)]
    fn fast_get(&self, data: &[u8], p: usize) -> Option<(Slot, usize)> {
        match *data.get(p)? {
            b'h' => Some((self.dense_memo(*data.get(p + 1)? as usize)?, p + 2)),
            b'j' => {
                let b = data.get(p + 1..p + 5)?;
                let i = u32::from_le_bytes(b.try_into().ok()?) as usize;
                Some((self.dense_memo(i)?, p + 5))
            }
            _ => None,
        }
    }

    /// Returns the position after the dict's `SETITEMS`, or `None` to leave it to the generic machine.
    fn try_fast_dict(&mut self) -> Option<usize> {
        let data = self.doc.data;
        let mut p = self.pos;
        let mut cells = 2;
        let memo_at = self.reserve_memo(data, &mut p, &mut cells)?;
        if *data.get(p)? != b'(' {
            return None;
        }
        p += 1;
        let mut items = [Slot::NONE; FAST_MAX_ITEMS];
        let mut n = 0;
        loop {
            let op = *data.get(p)?;
            let item = match op {
                b'h' | b'j' => {
                    let (s, next) = self.fast_get(data, p)?;
                    p = next;
                    s
                }
                b'K' => {
                    let v = *data.get(p + 1)?;
                    p += 2;
                    Slot::int(v as i64)
                }
                b'M' => {
                    let b = data.get(p + 1..p + 3)?;
                    p += 3;
                    Slot::int(u16::from_le_bytes([b[0], b[1]]) as i64)
                }
                b'J' => {
                    let b = data.get(p + 1..p + 5)?;
                    p += 5;
                    Slot::int(i32::from_le_bytes(b.try_into().ok()?) as i64)
                }
                0x8a => {
                    let len = *data.get(p + 1)? as usize;
                    let b = data.get(p + 2..p + 2 + len)?;
                    p += 2 + len;
                    Slot::int(small_long(b)?)
                }
                b'N' => {
                    p += 1;
                    Slot::NONE
                }
                0x88 | 0x89 => {
                    p += 1;
                    if op == 0x88 {
                        Slot::TRUE
                    } else {
                        Slot::FALSE
                    }
                }
                0x8c => {
                    let len = *data.get(p + 1)? as usize;
                    let off = p + 2;
                    let b = data.get(off..off + len)?;
                    if !b.is_ascii() && std::str::from_utf8(b).is_err() {
                        return None;
                    }
                    p = off + len;
                    Slot::short_span(T_STR, off, len).unwrap_or_else(|| {
                        self.doc.spans.push(Span { off, len });
                        Slot::tagged(T_STR, self.doc.spans.len() - 1)
                    })
                }
                0x94 => {
                    // MEMOIZE stores the item just read; it adds no item.
                    if n == 0 {
                        return None;
                    }
                    self.memo.push(items[n - 1]);
                    cells += 1;
                    p += 1;
                    continue;
                }
                b']' => {
                    let (list, next, used) = self.fast_list(data, p + 1)?;
                    p = next;
                    cells += used;
                    list
                }
                b'u' => {
                    p += 1;
                    break;
                }
                0x95 => {
                    // The pickler starts a new frame before any object once
                    // the current one is full, so frames split dicts too.
                    p = frame_end(data, p)?;
                    continue;
                }
                _ => return None,
            };
            if n == FAST_MAX_ITEMS {
                return None;
            }
            items[n] = item;
            n += 1;
        }
        if n == 0 || n % 2 != 0 || self.stack.len() >= self.limits.max_stack {
            return None;
        }
        let items = &items[..n];
        // The generic machine would report a limit here, so let it.
        if self.cells + cells + n > self.max_cells {
            return None;
        }
        let doc = &self.doc;
        let id = self.claim.as_mut().and_then(|c| c.claim(doc, items));
        let dict = match id {
            Some(id) => Slot::claimed(id),
            None => {
                let start = self.doc.slab.len();
                self.doc.slab.extend_from_slice(items);
                let mut c = Container::new(Kind::Dict);
                c.set_slab(start, n);
                self.doc.containers.push(c);
                cells += n;
                Slot::tagged(T_CONT, self.doc.containers.len() - 1)
            }
        };
        if let Some(i) = memo_at {
            self.memo[i] = dict;
        }
        self.cells += cells;
        self.stack.push(dict);
        Some(p)
    }

    /// Takes the memo cell of a container whose `EMPTY_DICT` or
    /// `EMPTY_LIST` was just read, if a `MEMOIZE` at `p` follows it,
    /// returning the cell's index.
    ///
    /// The container's slot is known only once the claim has answered, so
    /// the cell stays empty until then: a reference to the container from
    /// inside itself finds it empty and leaves the dict to the generic machine.
    fn reserve_memo(
        &mut self,
        data: &[u8],
        p: &mut usize,
        cells: &mut usize,
    ) -> Option<Option<usize>> {
        if *data.get(*p)? != 0x94 {
            return Some(None);
        }
        self.memo.push(Slot::EMPTY);
        *cells += 1;
        *p += 1;
        Some(Some(self.memo.len() - 1))
    }

    /// Reads a list of memo references after its `EMPTY_LIST` at `p`:
    /// returns the list, the next position and the cells it used.
    fn fast_list(&mut self, data: &[u8], mut p: usize) -> Option<(Slot, usize, usize)> {
        let mut c = Container::new(Kind::List);
        let mut cells = 2;
        let memo_at = self.reserve_memo(data, &mut p, &mut cells)?;
        let mut claimed = None;
        if *data.get(p)? == b'(' {
            if let Some(c) = self.lists.predict(&data[p + 1..], self.memo_epoch) {
                // The list that followed the previous two last time, with the
                // same bytes up to the same APPENDS: found without stepping
                // through its opcodes.
                claimed = Some(c.id);
                self.lists.shift(c.id);
                p += c.len + 2;
            } else {
                let (body_end, framed) = list_body_end(data, p + 1)?;
                let body = &data[p + 1..body_end];
                // A traceback's list is written anew each time but repeats the
                // bytes of an earlier one: the same memo references. While no
                // memo cell has been replaced those bytes mean the same slots,
                // so the earlier claim's answer holds without resolving them.
                // A body with a frame boundary inside is resolved every time.
                let mut cached = if framed {
                    None
                } else {
                    self.lists.get(body, self.memo_epoch)
                };
                claimed = cached.map(|c| c.id);
                if claimed.is_none() {
                    let start = self.doc.slab.len();
                    let mut q = p + 1;
                    while q < body_end {
                        if data[q] == 0x95 {
                            q = frame_end(data, q)?;
                            continue;
                        }
                        let (s, next) = self.fast_get(data, q)?;
                        self.doc.slab.push(s);
                        q = next;
                    }
                    let len = self.doc.slab.len() - start;
                    if len > SLAB_MAX_LEN {
                        return None;
                    }
                    let doc = &self.doc;
                    claimed = self
                        .claim
                        .as_mut()
                        .and_then(|cl| cl.claim_list(doc, &doc.slab[start..]));
                    if let Some(id) = claimed {
                        self.doc.slab.truncate(start);
                        if !framed {
                            cached = self.lists.put(body, self.memo_epoch, id);
                        }
                    } else {
                        c.set_slab(start, len);
                        cells += 2 * len;
                    }
                }
                self.lists.followed(cached);
                p = body_end + 1;
            }
        }
        let list = match claimed {
            Some(id) => Slot::claimed_list(id),
            None => {
                self.doc.containers.push(c);
                Slot::tagged(T_CONT, self.doc.containers.len() - 1)
            }
        };
        if let Some(i) = memo_at {
            self.memo[i] = list;
        }
        Some((list, p, cells))
    }
}

/// Decodes a `LONG1` payload that fits in a slot.
#[inline(always)]
fn small_long(b: &[u8]) -> Option<i64> {
    if b.is_empty() {
        return Some(0);
    }
    if b.len() > 8 {
        return None;
    }
    let v = sign_extend(b);
    (INLINE_MIN..=INLINE_MAX).contains(&v).then_some(v)
}

/// Returns where the `APPENDS` that ends a list body of memo references
/// starting at `p` is, and whether a `FRAME` lies inside it, or `None` if
/// the body holds anything else.
#[inline(always)]
fn list_body_end(data: &[u8], mut p: usize) -> Option<(usize, bool)> {
    let mut framed = false;
    loop {
        match *data.get(p)? {
            b'h' => p += 2,
            b'j' => p += 5,
            b'e' => return Some((p, framed)),
            0x95 => {
                p = frame_end(data, p)?;
                framed = true;
            }
            _ => return None,
        }
    }
}

/// Returns the position after the `FRAME` opcode at `p`, or `None` if its
/// length runs past the input (which the generic machine then reports).
#[inline(always)]
fn frame_end(data: &[u8], p: usize) -> Option<usize> {
    let b = data.get(p + 1..p + 9)?;
    let n = u64::from_le_bytes(b.try_into().ok()?);
    (n <= (data.len() - p - 9) as u64).then_some(p + 9)
}

/// Most list bodies the cache remembers, and most bytes it keeps, so that
/// hostile input cannot grow it beyond a few megabytes.
const LIST_CACHE_MAX: usize = 1 << 16;
const LIST_CACHE_MAX_BYTES: usize = 8 << 20;

/// Claimed list bodies by their bytes, with the memo epoch they were read in.
///
/// A body is found two ways. First by prediction: a training loop allocates
/// in the same order step after step, so the list that followed the
/// previous two lists last time is likely to follow them again, and checking
/// that its bytes and `APPENDS` are there needs no step through the
/// opcodes. Otherwise by the hash of the whole body, which needs its end
/// first.
///
/// Bodies read inside a dict on the fast path wait in `pending` until the
/// dict is complete: if the dict goes to the generic machine after all, the
/// memo cells they may refer to are filled again, perhaps differently.
pub(super) struct ListCache {
    by_hash: HashMap<u64, Cached, BuildKeyHash>,
    /// The body that followed each pair of bodies, by [`context`] of their numbers.
    next: HashMap<u64, Cached, BuildKeyHash>,
    /// The numbers of the last two bodies read ([`NOT_CACHED`] for one not
    /// cached), and of the last two read by a complete dict.
    last: [u32; 2],
    committed_last: [u32; 2],
    bytes: Vec<u8>,
    pending: Vec<(u64, Cached)>,
    pending_next: Vec<(u64, Cached)>,
}

impl Default for ListCache {
    fn default() -> Self {
        ListCache {
            by_hash: HashMap::default(),
            next: HashMap::default(),
            last: [NOT_CACHED; 2],
            committed_last: [NOT_CACHED; 2],
            bytes: Vec::new(),
            pending: Vec::new(),
            pending_next: Vec::new(),
        }
    }
}

/// Stands for a list that was not cached among the last two.
const NOT_CACHED: u32 = u32::MAX;

/// A well-mixed key for the pair of the last two list numbers.
fn context(last: [u32; 2]) -> u64 {
    let h = (last[0] as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (last[1] as u64).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 29)
}

/// Where a claimed body's bytes are kept, the memo epoch it was read in, and its number.
#[derive(Clone, Copy)]
struct Cached {
    start: usize,
    len: usize,
    epoch: u64,
    id: u32,
}

/// Hashes keys that are already well-mixed hashes by taking them as they are.
#[derive(Clone, Copy, Default)]
pub(super) struct BuildKeyHash;

/// The hasher of [`BuildKeyHash`].
#[derive(Default)]
pub(super) struct KeyHash(u64);

impl std::hash::BuildHasher for BuildKeyHash {
    type Hasher = KeyHash;
    fn build_hasher(&self) -> KeyHash {
        KeyHash(0)
    }
}

impl std::hash::Hasher for KeyHash {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | b as u64).rotate_left(5);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

impl ListCache {
    fn hash(body: &[u8]) -> u64 {
        // Four independent multiply lanes over eight-byte words; the
        // length goes in last so that bodies padded with zeros differ.
        let mut lanes = [0u64; 4];
        let mut words = body.chunks_exact(8);
        for (i, w) in (&mut words).enumerate() {
            let v = u64::from_le_bytes(w.try_into().unwrap_or_default());
            let l = &mut lanes[i % 4];
            *l = (*l ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
        }
        let mut tail = [0u8; 8];
        tail[..words.remainder().len()].copy_from_slice(words.remainder());
        let mut h =
            u64::from_le_bytes(tail) ^ (body.len() as u64).wrapping_mul(0xff51_afd7_ed55_8ccd);
        for l in lanes {
            h = (h ^ l).wrapping_mul(0xc4ce_b9fe_1a85_ec53).rotate_left(31);
        }
        h ^ (h >> 32)
    }

    /// Returns the body that followed the last one before, if `rest` starts
    /// with its bytes and an `APPENDS`.
    fn predict(&self, rest: &[u8], epoch: u64) -> Option<Cached> {
        let c = *self.next.get(&context(self.last))?;
        (c.epoch == epoch
            && rest.get(c.len) == Some(&b'e')
            && rest[..c.len] == self.bytes[c.start..c.start + c.len])
            .then_some(c)
    }

    fn get(&self, body: &[u8], epoch: u64) -> Option<Cached> {
        let c = *self.by_hash.get(&Self::hash(body))?;
        (c.epoch == epoch && self.bytes[c.start..c.start + c.len] == *body).then_some(c)
    }

    fn put(&mut self, body: &[u8], epoch: u64, id: u32) -> Option<Cached> {
        if self.by_hash.len() + self.pending.len() >= LIST_CACHE_MAX
            || self.bytes.len() + body.len() > LIST_CACHE_MAX_BYTES
        {
            return None;
        }
        let entry = Cached {
            start: self.bytes.len(),
            len: body.len(),
            epoch,
            id,
        };
        self.pending.push((Self::hash(body), entry));
        self.bytes.extend_from_slice(body);
        Some(entry)
    }

    /// Records that the list just read was `body` (`None`: one not cached).
    fn followed(&mut self, body: Option<Cached>) {
        if let Some(b) = body {
            let ctx = context(self.last);
            if self.next.get(&ctx).is_none_or(|c| c.start != b.start) {
                self.pending_next.push((ctx, b));
            }
        }
        self.shift(body.map_or(NOT_CACHED, |b| b.id));
    }

    /// Makes `id` the number of the last body read. A predicted body needs
    /// only this: that it follows the two before it is what predicted it.
    fn shift(&mut self, id: u32) {
        self.last = [self.last[1], id];
    }

    fn commit(&mut self) {
        for (h, entry) in self.pending.drain(..) {
            self.by_hash.insert(h, entry);
        }
        for (ctx, entry) in self.pending_next.drain(..) {
            if self.next.len() < LIST_CACHE_MAX {
                self.next.insert(ctx, entry);
            }
        }
        self.committed_last = self.last;
    }

    fn discard(&mut self) {
        if let Some(&(_, first)) = self.pending.first() {
            self.bytes.truncate(first.start);
        }
        self.pending.clear();
        self.pending_next.clear();
        self.last = self.committed_last;
    }
}
