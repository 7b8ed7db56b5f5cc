//! A pickled value as JSON, bounded in depth and size: what a snapshot's
//! allocator settings and annotations are reported as.

use oomkit_pickle::{Document, Kind, Slot, Value};

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
