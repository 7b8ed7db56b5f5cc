//! A canonical text form of a value, to compare with CPython's own reading.

use crate::value::{Document, Kind, Slot, Value};
use std::fmt::Write;

/// Values [`Document::repr`] renders at most. A few kilobytes of pickle can
/// hold containers that share each other many times over, whose text grows
/// exponentially with depth; past this many values the rest print `...`.
/// Every document the tests compare with CPython is far smaller.
pub const REPR_MAX_VALUES: usize = 1_000_000;

impl Document<'_> {
    /// Renders a value in a canonical form that a few lines of Python can
    /// reproduce from `pickle.loads`, so the two readers can be compared.
    ///
    /// Strings and bytes print as hex, floats as their IEEE bits, integers
    /// in decimal, dicts in Python's order (first insertion, last value),
    /// sets sorted. Walks deeper than `max_depth`, cycles, and values past
    /// the first [`REPR_MAX_VALUES`] print `...`.
    pub fn repr(&self, slot: Slot, max_depth: usize) -> String {
        let mut out = String::new();
        let mut path = Vec::new();
        let mut left = REPR_MAX_VALUES;
        self.repr_into(slot, max_depth, &mut path, &mut left, &mut out);
        out
    }

    fn repr_into(
        &self,
        slot: Slot,
        depth: usize,
        path: &mut Vec<Slot>,
        left: &mut usize,
        out: &mut String,
    ) {
        if *left == 0 {
            out.push_str("...");
            return;
        }
        *left -= 1;
        match self.value(slot) {
            Value::None => out.push_str("None"),
            Value::Bool(b) => out.push_str(if b { "True" } else { "False" }),
            Value::Int(v) => {
                let _ = write!(out, "{v}");
            }
            Value::BigInt(bytes) => out.push_str(&bigint_decimal(bytes)),
            Value::Float(f) => {
                let _ = write!(out, "f{:016x}", f.to_bits());
            }
            Value::Str(s) => hex(out, "s", s.as_bytes()),
            Value::Bytes(b) => hex(out, "b", b),
            Value::ByteArray(b) => hex(out, "ba", b),
            Value::Container(kind) => {
                if depth == 0 || path.contains(&slot) {
                    out.push_str("...");
                    return;
                }
                path.push(slot);
                let items = self.items(slot).unwrap_or(&[]);
                let mut child = |s: Slot, path: &mut Vec<Slot>| {
                    let mut o = String::new();
                    self.repr_into(s, depth - 1, path, left, &mut o);
                    o
                };
                match kind {
                    Kind::List | Kind::Tuple => {
                        let parts: Vec<String> = items.iter().map(|&s| child(s, path)).collect();
                        let (open, close) = if kind == Kind::List {
                            ("[", "]")
                        } else {
                            ("(", ")")
                        };
                        let _ = write!(out, "{open}{}{close}", parts.join(","));
                    }
                    Kind::Set | Kind::FrozenSet => {
                        let mut parts: Vec<String> =
                            items.iter().map(|&s| child(s, path)).collect();
                        parts.sort();
                        parts.dedup();
                        let name = if kind == Kind::Set {
                            "set"
                        } else {
                            "frozenset"
                        };
                        let _ = write!(out, "{name}{{{}}}", parts.join(","));
                    }
                    Kind::Dict => {
                        let mut keys: Vec<String> = Vec::new();
                        let mut vals: Vec<String> = Vec::new();
                        for pair in items.chunks_exact(2) {
                            let k = child(pair[0], path);
                            let v = child(pair[1], path);
                            match keys.iter().position(|x| *x == k) {
                                Some(i) => vals[i] = v,
                                None => {
                                    keys.push(k);
                                    vals.push(v);
                                }
                            }
                        }
                        let parts: Vec<String> = keys
                            .iter()
                            .zip(&vals)
                            .map(|(k, v)| format!("{k}:{v}"))
                            .collect();
                        let _ = write!(out, "{{{}}}", parts.join(","));
                    }
                }
                path.pop();
            }
        }
    }
}

fn hex(out: &mut String, prefix: &str, bytes: &[u8]) {
    out.push_str(prefix);
    out.push(':');
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
}

/// Converts little-endian two's complement bytes of any width to decimal.
fn bigint_decimal(bytes: &[u8]) -> String {
    let negative = bytes.last().is_some_and(|b| b & 0x80 != 0);
    let mut mag: Vec<u8> = bytes.to_vec();
    if negative {
        // Two's complement negation gives the magnitude.
        let mut carry = 1u16;
        for b in mag.iter_mut() {
            let v = (!*b) as u16 + carry;
            *b = v as u8;
            carry = v >> 8;
        }
    }
    // Big-endian base-2^32 limbs, divided by 10^9 repeatedly.
    let mut limbs: Vec<u32> = mag
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect();
    limbs.reverse();
    let mut chunks = Vec::new();
    while limbs.iter().any(|&l| l != 0) {
        let mut rem = 0u64;
        for l in limbs.iter_mut() {
            let cur = (rem << 32) | *l as u64;
            *l = (cur / 1_000_000_000) as u32;
            rem = cur % 1_000_000_000;
        }
        chunks.push(rem as u32);
    }
    let mut s = String::new();
    if negative {
        s.push('-');
    }
    match chunks.split_last() {
        None => s.push('0'),
        Some((first, rest)) => {
            let _ = write!(s, "{first}");
            for c in rest.iter().rev() {
                let _ = write!(s, "{c:09}");
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::bigint_decimal;

    #[test]
    fn decimal_of_wide_integers() {
        assert_eq!(bigint_decimal(&[]), "0");
        assert_eq!(bigint_decimal(&[0xff]), "-1");
        assert_eq!(bigint_decimal(&[0x00, 0x80]), "-32768");
        // 2**64 = 0x1_0000_0000_0000_0000
        assert_eq!(
            bigint_decimal(&[0, 0, 0, 0, 0, 0, 0, 0, 1]),
            "18446744073709551616"
        );
        // -(2**64)
        assert_eq!(
            bigint_decimal(&[0, 0, 0, 0, 0, 0, 0, 0, 0xff]),
            "-18446744073709551616"
        );
    }
}
