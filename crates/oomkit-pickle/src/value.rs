//! The arena of parsed values and read-only views over it.

use std::fmt;

/// One value in a [`Document`]: an 8-byte handle, cheap to copy.
///
/// Small integers, `None` and booleans live inside the handle, and so does
/// the place in the input of a string, bytes or wide integer of up to 255
/// bytes; everything else is an index into the document's tables. Two
/// slots that refer to the same shared object (through the pickle memo)
/// are equal.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot(pub(crate) u64);

pub(crate) const TAG_BITS: u32 = 3;
pub(crate) const TAG_MASK: u64 = (1 << TAG_BITS) - 1;
pub(crate) const T_INT: u64 = 0;
pub(crate) const T_STR: u64 = 1;
pub(crate) const T_CONT: u64 = 2;
pub(crate) const T_FLOAT: u64 = 3;
pub(crate) const T_BIGINT: u64 = 4;
pub(crate) const T_BYTES: u64 = 5;
/// `None`, the booleans, and the dicts and lists a claim took over on the
/// fast path (index 3 and above), which keep no table entry of their own.
pub(crate) const T_CONST: u64 = 6;
pub(crate) const T_BYTEARRAY: u64 = 7;

/// The index bit of a span slot that keeps its offset and length itself.
const SHORT_SPAN: u64 = 1 << 60;
/// Longest span a slot keeps itself (the length takes the index's low byte).
const SHORT_SPAN_MAX_LEN: usize = 0xff;
/// Furthest offset a slot keeps itself.
const SHORT_SPAN_MAX_OFF: usize = (1 << 52) - 1;

/// The largest integer stored inline in a slot.
pub(crate) const INLINE_MAX: i64 = (1 << 60) - 1;
/// The smallest integer stored inline in a slot.
pub(crate) const INLINE_MIN: i64 = -(1 << 60);

impl Slot {
    pub(crate) const NONE: Slot = Slot(T_CONST);
    pub(crate) const FALSE: Slot = Slot((1 << TAG_BITS) | T_CONST);
    pub(crate) const TRUE: Slot = Slot((2 << TAG_BITS) | T_CONST);
    /// Marks an empty memo cell; never handed out.
    pub(crate) const EMPTY: Slot = Slot(u64::MAX);
    /// First `T_CONST` index of a claimed dict or list; even offsets are dicts.
    const CLAIMED_BASE: u64 = 3;

    /// Makes the slot of a dict taken over by a claim as number `id`.
    ///
    /// A trace holds one such dict per entry; keeping no container for it
    /// saves a table write and eight bytes per entry.
    pub(crate) fn claimed(id: u32) -> Slot {
        Slot(((2 * id as u64 + Self::CLAIMED_BASE) << TAG_BITS) | T_CONST)
    }

    /// Makes the slot of a list taken over by a claim as number `id`.
    pub(crate) fn claimed_list(id: u32) -> Slot {
        Slot(((2 * id as u64 + 1 + Self::CLAIMED_BASE) << TAG_BITS) | T_CONST)
    }

    /// Returns the kind and claim number of a slot made by [`Slot::claimed`] or [`Slot::claimed_list`].
    pub(crate) fn claimed_id(self) -> Option<(Kind, u32)> {
        let i = self.0 >> TAG_BITS;
        if self.tag() != T_CONST || i < Self::CLAIMED_BASE {
            return None;
        }
        let n = i - Self::CLAIMED_BASE;
        let kind = if n.is_multiple_of(2) {
            Kind::Dict
        } else {
            Kind::List
        };
        Some((kind, (n / 2) as u32))
    }

    pub(crate) fn int(v: i64) -> Slot {
        debug_assert!((INLINE_MIN..=INLINE_MAX).contains(&v));
        Slot(((v as u64) << TAG_BITS) | T_INT)
    }
    /// Reads back an integer stored by [`Slot::int`]; the tag must be `T_INT`.
    pub(crate) fn int_value(self) -> i64 {
        (self.0 as i64) >> TAG_BITS
    }
    /// Makes the slot of a string, bytes or wide integer at `off` in the
    /// input, keeping `off` and `len` inside the slot when they fit and
    /// returning `None` (a span in the table is needed) otherwise.
    ///
    /// A trace entry holds a fresh short string or two (`'N/A'`); keeping
    /// them out of the span table saves 16 bytes of fresh memory each.
    pub(crate) fn short_span(tag: u64, off: usize, len: usize) -> Option<Slot> {
        (len <= SHORT_SPAN_MAX_LEN && off <= SHORT_SPAN_MAX_OFF).then_some(Slot(
            ((SHORT_SPAN | (off as u64) << 8 | len as u64) << TAG_BITS) | tag,
        ))
    }

    /// Returns the offset and length kept by [`Slot::short_span`], if this slot has them.
    pub(crate) fn short_span_of(self) -> Option<(usize, usize)> {
        let i = self.0 >> TAG_BITS;
        (i & SHORT_SPAN != 0).then_some((((i & !SHORT_SPAN) >> 8) as usize, (i & 0xff) as usize))
    }

    pub(crate) fn tagged(tag: u64, index: usize) -> Slot {
        Slot(((index as u64) << TAG_BITS) | tag)
    }
    pub(crate) fn tag(self) -> u64 {
        self.0 & TAG_MASK
    }
    pub(crate) fn index(self) -> usize {
        (self.0 >> TAG_BITS) as usize
    }
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Slot(tag={}, {})", self.tag(), self.0 >> TAG_BITS)
    }
}

/// The Python type of a container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A `list`.
    List,
    /// A `tuple`.
    Tuple,
    /// A `dict`; its items alternate key, value.
    Dict,
    /// A `set`.
    Set,
    /// A `frozenset`.
    FrozenSet,
}

/// Where a container's items live, packed into 8 bytes because a snapshot
/// holds one container per trace entry.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Container {
    /// Start in the slab, index in `own`, or the claim number.
    start: u32,
    /// Length (slab containers only) above five flag bits: kind, own, claimed.
    meta: u32,
}

const KIND_SHIFT: u32 = 2;
const OWN_BIT: u32 = 1 << 1;
const CLAIMED_BIT: u32 = 1;
const LEN_SHIFT: u32 = 5;
/// Most items a container keeps in the slab; longer ones move to `own`.
pub(crate) const SLAB_MAX_LEN: usize = (u32::MAX >> LEN_SHIFT) as usize;

/// Where a container's items are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// `len` items of the slab from `start`.
    Slab { start: usize, len: usize },
    /// Its own vector, `own[index]`.
    Own(usize),
    /// Taken over by a claim, with this number.
    Claimed(u32),
}

impl Container {
    pub(crate) fn new(kind: Kind) -> Container {
        Container {
            start: 0,
            meta: (kind as u32) << KIND_SHIFT,
        }
    }

    pub(crate) fn kind(self) -> Kind {
        match (self.meta >> KIND_SHIFT) & 7 {
            0 => Kind::List,
            1 => Kind::Tuple,
            2 => Kind::Dict,
            3 => Kind::Set,
            _ => Kind::FrozenSet,
        }
    }

    pub(crate) fn place(self) -> Place {
        if self.meta & CLAIMED_BIT != 0 {
            Place::Claimed(self.start)
        } else if self.meta & OWN_BIT != 0 {
            Place::Own(self.start as usize)
        } else {
            Place::Slab {
                start: self.start as usize,
                len: (self.meta >> LEN_SHIFT) as usize,
            }
        }
    }

    /// Points the container at a slab range; `start` and `len` are checked by the caller.
    pub(crate) fn set_slab(&mut self, start: usize, len: usize) {
        debug_assert!(len <= SLAB_MAX_LEN && start <= u32::MAX as usize);
        self.start = start as u32;
        self.meta = (self.meta & (7 << KIND_SHIFT)) | ((len as u32) << LEN_SHIFT);
    }

    pub(crate) fn set_own(&mut self, index: usize) {
        self.start = index as u32;
        self.meta = (self.meta & (7 << KIND_SHIFT)) | OWN_BIT;
    }

    pub(crate) fn set_claimed(&mut self, id: u32) {
        self.start = id;
        self.meta = (self.meta & (7 << KIND_SHIFT)) | CLAIMED_BIT;
    }
}

/// A byte range of the input.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    pub(crate) off: usize,
    pub(crate) len: usize,
}

/// A decoded view of one [`Slot`].
#[derive(Clone, Copy, Debug)]
pub enum Value<'d> {
    /// `None`.
    None,
    /// `True` or `False`.
    Bool(bool),
    /// An integer that fits in 61 bits.
    Int(i64),
    /// A wider integer, as little-endian two's complement bytes.
    BigInt(&'d [u8]),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(&'d str),
    /// A `bytes` value.
    Bytes(&'d [u8]),
    /// A `bytearray` value.
    ByteArray(&'d [u8]),
    /// A container; read its items with [`Document::seq`] or [`Document::dict_items`].
    Container(Kind),
}

/// A parsed pickle: the arena of its values and the root slot.
///
/// The arena is flat, so dropping it never recurses, and it may contain
/// cycles (a list that holds itself) exactly as the pickle describes them.
pub struct Document<'a> {
    pub(crate) data: &'a [u8],
    pub(crate) spans: Vec<Span>,
    pub(crate) floats: Vec<f64>,
    pub(crate) containers: Vec<Container>,
    pub(crate) slab: Vec<Slot>,
    pub(crate) own: Vec<Vec<Slot>>,
    pub(crate) root: Slot,
    pub(crate) protocol: u8,
}

impl<'a> Document<'a> {
    /// Returns the object the pickle evaluates to.
    pub fn root(&self) -> Slot {
        self.root
    }

    /// Returns the protocol named by the pickle's `PROTO` opcode (0 if absent).
    pub fn protocol(&self) -> u8 {
        self.protocol
    }

    /// Returns how many containers the arena holds.
    pub fn container_count(&self) -> usize {
        self.containers.len()
    }

    /// Decodes a slot.
    pub fn value(&self, slot: Slot) -> Value<'a> {
        match slot.tag() {
            T_INT => Value::Int(slot.int_value()),
            T_STR => Value::Str(self.str_at(slot)),
            T_CONT => Value::Container(self.containers[slot.index()].kind()),
            T_FLOAT => Value::Float(self.floats[slot.index()]),
            T_BIGINT => Value::BigInt(self.span(slot)),
            T_BYTES => Value::Bytes(self.span(slot)),
            T_BYTEARRAY => Value::ByteArray(self.span(slot)),
            _ => match slot.index() {
                0 => Value::None,
                1 => Value::Bool(false),
                2 => Value::Bool(true),
                _ => Value::Container(slot.claimed_id().map_or(Kind::Dict, |(k, _)| k)),
            },
        }
    }

    /// Returns the input bytes of a string, bytes or wide-integer slot.
    fn span(&self, slot: Slot) -> &'a [u8] {
        let (off, len) = slot.short_span_of().unwrap_or_else(|| {
            let s = self.spans[slot.index()];
            (s.off, s.len)
        });
        &self.data[off..off + len]
    }

    fn str_at(&self, slot: Slot) -> &'a str {
        // Validated when parsed; checking again keeps this crate free of
        // unsafe code and costs little on the short strings of snapshots.
        std::str::from_utf8(self.span(slot)).unwrap_or("")
    }

    /// Returns the string in `slot`, if it is one.
    pub fn as_str(&self, slot: Slot) -> Option<&'a str> {
        (slot.tag() == T_STR).then(|| self.str_at(slot))
    }

    /// Returns the raw UTF-8 bytes of a string slot without validating them again.
    pub fn str_bytes(&self, slot: Slot) -> Option<&'a [u8]> {
        (slot.tag() == T_STR).then(|| self.span(slot))
    }

    /// Returns the integer in `slot` if it fits in an `i64` (booleans count as 0 and 1).
    #[inline]
    pub fn as_i64(&self, slot: Slot) -> Option<i64> {
        // Nearly every integer in a snapshot is inline; decode it on the spot.
        if slot.tag() == T_INT {
            return Some(slot.int_value());
        }
        match self.value(slot) {
            Value::Int(v) => Some(v),
            Value::Bool(b) => Some(b as i64),
            Value::BigInt(bytes) => bigint_to_i128(bytes).and_then(|v| i64::try_from(v).ok()),
            _ => None,
        }
    }

    /// Returns the integer in `slot` if it fits in an `i128`.
    #[inline]
    pub fn as_i128(&self, slot: Slot) -> Option<i128> {
        if slot.tag() == T_BIGINT {
            return bigint_to_i128(self.span(slot));
        }
        self.as_i64(slot).map(i128::from)
    }

    /// Returns the number in `slot` as a float, for ints and floats alike.
    pub fn as_f64(&self, slot: Slot) -> Option<f64> {
        match self.value(slot) {
            Value::Float(f) => Some(f),
            _ => self.as_i128(slot).map(|v| v as f64),
        }
    }

    /// Returns the container kind of `slot`, if it is a container.
    pub fn kind(&self, slot: Slot) -> Option<Kind> {
        if let Some((kind, _)) = slot.claimed_id() {
            return Some(kind);
        }
        (slot.tag() == T_CONT).then(|| self.containers[slot.index()].kind())
    }

    /// Returns the number a [`crate::Claim`] gave this dict when it took it over.
    pub fn claimed(&self, slot: Slot) -> Option<u32> {
        if slot.tag() != T_CONT {
            return match slot.claimed_id() {
                Some((Kind::Dict, id)) => Some(id),
                _ => None,
            };
        }
        match self.containers[slot.index()].place() {
            Place::Claimed(id) => Some(id),
            _ => None,
        }
    }

    /// Returns the number [`crate::Claim::claim_list`] gave this list when it took it over.
    pub fn claimed_list(&self, slot: Slot) -> Option<u32> {
        match slot.claimed_id() {
            Some((Kind::List, id)) => Some(id),
            _ => None,
        }
    }

    /// Returns a container's raw items (for a dict: key, value, key, value, ...).
    ///
    /// A claimed dict has no items left in the document.
    pub fn items(&self, slot: Slot) -> Option<&[Slot]> {
        if slot.tag() != T_CONT {
            return slot.claimed_id().map(|_| &[][..]);
        }
        Some(match self.containers[slot.index()].place() {
            Place::Slab { start, len } => &self.slab[start..start + len],
            Place::Own(i) => &self.own[i],
            Place::Claimed(_) => &[],
        })
    }

    /// Returns the items of a list, tuple, set or frozenset.
    pub fn seq(&self, slot: Slot) -> Option<&[Slot]> {
        match self.kind(slot)? {
            Kind::Dict => None,
            _ => self.items(slot),
        }
    }

    /// Iterates over a dict's `(key, value)` pairs in pickle order, duplicates included.
    pub fn dict_items(&self, slot: Slot) -> Option<impl Iterator<Item = (Slot, Slot)> + '_> {
        if self.kind(slot)? != Kind::Dict {
            return None;
        }
        Some(self.items(slot)?.chunks_exact(2).map(|p| (p[0], p[1])))
    }

    /// Looks up a string key in a dict; the last duplicate wins, as in Python.
    pub fn dict_get(&self, slot: Slot, key: &str) -> Option<Slot> {
        if self.kind(slot)? != Kind::Dict {
            return None;
        }
        let items = self.items(slot)?;
        items
            .chunks_exact(2)
            .rev()
            .find(|p| self.str_bytes(p[0]) == Some(key.as_bytes()))
            .map(|p| p[1])
    }
}

/// Converts little-endian two's complement bytes to an `i128` when they fit.
pub(crate) fn bigint_to_i128(bytes: &[u8]) -> Option<i128> {
    if bytes.is_empty() {
        return Some(0);
    }
    let negative = bytes[bytes.len() - 1] & 0x80 != 0;
    let fill = if negative { 0xff } else { 0 };
    // Sign-extension bytes beyond 16 do not change the value.
    let significant = bytes.iter().rposition(|&b| b != fill).map_or(0, |i| i + 1);
    if significant > 16 || (significant == 16 && (bytes[15] & 0x80 != 0) != negative) {
        return None;
    }
    let mut buf = [fill; 16];
    buf[..significant].copy_from_slice(&bytes[..significant]);
    Some(i128::from_le_bytes(buf))
}
