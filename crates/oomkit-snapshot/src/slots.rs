//! What the readers share about the document's slots: a one-probe cache
//! keyed by slot, and what a slot holds, in words, for an error that
//! names a field of the wrong type.

use crate::error::Error;
use crate::hash::FastHasher;
use oomkit_pickle::{Document, Kind, Slot, Value};

/// A direct-mapped cache from slots to small values: one probe, no
/// collision chains, a colliding slot simply replaces the older one.
pub(crate) struct SlotCache<T: Copy> {
    buckets: Vec<Option<(Slot, T)>>,
}

impl<T: Copy> SlotCache<T> {
    /// Makes a cache of `n` buckets, a power of two.
    pub(crate) fn new(n: usize) -> Self {
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

    pub(crate) fn get(&self, slot: Slot) -> Option<T> {
        match self.buckets[self.bucket(slot)] {
            Some((s, v)) if s == slot => Some(v),
            _ => None,
        }
    }

    pub(crate) fn put(&mut self, slot: Slot, value: T) {
        let at = self.bucket(slot);
        self.buckets[at] = Some((slot, value));
    }
}

/// The Python type of what a slot holds, as an error names it.
pub(crate) fn type_name(doc: &Document<'_>, s: Slot) -> &'static str {
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

/// The error for a field that holds something else than `want`.
pub(crate) fn field_err(
    doc: &Document<'_>,
    at: impl FnOnce() -> String,
    slot: Slot,
    want: &str,
) -> Error {
    Error::Field {
        at: at(),
        problem: format!("expected {want}, found {}", type_name(doc, slot)),
    }
}
