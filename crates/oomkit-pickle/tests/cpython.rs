//! Differential tests: CPython writes and reads each value, we read it, and
//! the two canonical renderings must be identical.

use oomkit_pickle::{Claim, Document, Error, Kind, Limits, Slot, Value};
use proptest::prelude::*;
use serde_json::{json, Value as Json};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, OnceLock};

struct Python {
    _child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

fn python() -> &'static Mutex<Python> {
    static PY: OnceLock<Mutex<Python>> = OnceLock::new();
    PY.get_or_init(|| {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cpython_pickle.py");
        let mut child = Command::new(std::env::var("PYTHON").unwrap_or("python3".into()))
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 is needed for the differential tests");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Mutex::new(Python {
            _child: child,
            stdin,
            stdout,
        })
    })
}

/// Asks CPython to pickle a value; returns the pickle and CPython's canonical reading.
fn cpython(req: Json) -> (Vec<u8>, String) {
    let mut py = python().lock().unwrap_or_else(|e| e.into_inner());
    writeln!(py.stdin, "{req}").unwrap();
    py.stdin.flush().unwrap();
    let mut line = String::new();
    py.stdout.read_line(&mut line).unwrap();
    let reply: Json = serde_json::from_str(&line).unwrap();
    if let Some(e) = reply.get("error") {
        panic!("CPython failed on {req}: {e}");
    }
    let hex = reply["pickle"].as_str().unwrap();
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    (bytes, reply["canon"].as_str().unwrap().to_string())
}

fn ours(bytes: &[u8]) -> String {
    let doc = Document::parse(bytes).unwrap_or_else(|e| panic!("{e}"));
    doc.repr(doc.root(), 1000)
}

fn hexs(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Generates value descriptions that CPython pickles with data opcodes only
/// at `proto` (bytes need 3, sets and frozensets 4, bytearray 5).
fn desc(proto: u8) -> impl Strategy<Value = Json> {
    let int = prop_oneof![
        any::<i64>().prop_map(|v| v.to_string()),
        (-300i64..300).prop_map(|v| v.to_string()),
        any::<u128>().prop_map(|v| v.to_string()),
        any::<i128>().prop_map(|v| format!("{v}{}", "0".repeat((v.unsigned_abs() % 40) as usize))),
    ];
    let mut leaf = vec![
        Just(json!({"n": null})).boxed(),
        any::<bool>().prop_map(|b| json!({"b": b})).boxed(),
        int.prop_map(|s| json!({"i": s})).boxed(),
        any::<u64>()
            .prop_map(|b| json!({"f": hexs(&b.to_le_bytes())}))
            .boxed(),
        ".{0,300}".prop_map(|s| json!({"s": s})).boxed(),
    ];
    if proto >= 3 {
        leaf.push(
            proptest::collection::vec(any::<u8>(), 0..300)
                .prop_map(|b| json!({"y": hexs(&b)}))
                .boxed(),
        );
    }
    if proto >= 5 {
        leaf.push(
            proptest::collection::vec(any::<u8>(), 0..40)
                .prop_map(|b| json!({"ba": hexs(&b)}))
                .boxed(),
        );
    }
    let leaf = proptest::strategy::Union::new(leaf);
    leaf.prop_recursive(5, 200, 12, move |inner| {
        let key = prop_oneof![
            "[a-z_]{0,12}".prop_map(|s| json!({"s": s})),
            any::<i32>().prop_map(|v| json!({"i": v.to_string()})),
        ];
        let mut branches = vec![
            proptest::collection::vec(inner.clone(), 0..12)
                .prop_map(|v| json!({"l": v}))
                .boxed(),
            proptest::collection::vec(inner.clone(), 0..6)
                .prop_map(|v| json!({"t": v}))
                .boxed(),
            proptest::collection::vec((key, inner.clone()), 0..10)
                .prop_map(
                    |v| json!({"d": v.into_iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>()}),
                )
                .boxed(),
            (0usize..8).prop_map(|k| json!({"share": k})).boxed(),
        ];
        if proto >= 4 {
            branches.push(
                proptest::collection::vec("[a-z]{0,6}".prop_map(|s| json!({"s": s})), 0..8)
                    .prop_map(|v| json!({"set": v}))
                    .boxed(),
            );
            branches.push(
                proptest::collection::vec("[a-z]{0,6}".prop_map(|s| json!({"s": s})), 0..8)
                    .prop_map(|v| json!({"fs": v}))
                    .boxed(),
            );
        }
        proptest::strategy::Union::new(branches)
    })
}

/// Generates lists shaped like a snapshot's trace: frame dicts first, then
/// entries whose keys are shared strings and whose values are integers of
/// every width, short strings, constants and lists of shared frames.
fn trace_like() -> impl Strategy<Value = Json> {
    const KEYS: &[&str] = &[
        "action",
        "addr",
        "size",
        "stream",
        "time_us",
        "frames",
        "device_free",
        "compile_context",
    ];
    let key = || proptest::sample::select(KEYS).prop_map(|k| json!({"k": k}));
    let frame = ("[a-z/.]{0,20}", any::<i32>(), "[a-z_]{0,8}").prop_map(|(f, l, n)| {
        json!({"d": [[{"k": "filename"}, {"s": f}], [{"k": "line"}, {"i": l.to_string()}], [{"k": "name"}, {"s": n}]]})
    });
    let value = prop_oneof![
        any::<u8>().prop_map(|v| json!({"i": v.to_string()})),
        any::<u16>().prop_map(|v| json!({"i": v.to_string()})),
        any::<i32>().prop_map(|v| json!({"i": v.to_string()})),
        any::<i64>().prop_map(|v| json!({"i": v.to_string()})),
        any::<u64>().prop_map(|v| json!({"i": v.to_string()})),
        any::<i128>().prop_map(|v| json!({"i": v.to_string()})),
        "[a-z_]{0,8}".prop_map(|s| json!({"s": s})),
        ".{0,4}".prop_map(|s| json!({"s": s})),
        proptest::sample::select(&["alloc", "free_completed", "N/A"][..])
            .prop_map(|k| json!({"k": k})),
        Just(json!({"n": null})),
        any::<bool>().prop_map(|b| json!({"b": b})),
        proptest::collection::vec((0usize..64).prop_map(|k| json!({"share": k})), 0..6)
            .prop_map(|v| json!({"l": v})),
        (0usize..64).prop_map(|k| json!({"share": k})),
    ];
    let entry = proptest::collection::vec((key(), value), 0..10)
        .prop_map(|v| json!({"d": v.into_iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>()}));
    (
        proptest::collection::vec(frame, 1..6),
        proptest::collection::vec(entry, 0..24),
    )
        .prop_map(|(frames, entries)| json!({"l": [{"l": frames}, {"l": entries}]}))
}

fn check(proto: u8, value: Json) -> Result<(), TestCaseError> {
    let (bytes, theirs) = cpython(json!({"proto": proto, "value": value}));
    prop_assert_eq!(ours(&bytes), theirs);
    Ok(())
}

/// Renders the items of every dict offered to it, claiming them or not.
struct Recorder {
    take: bool,
    seen: Vec<String>,
}

impl Claim for Recorder {
    fn claim(&mut self, doc: &Document<'_>, items: &[Slot]) -> Option<u32> {
        let items: Vec<String> = items.iter().map(|&s| doc.repr(s, 1000)).collect();
        self.seen.push(items.join(","));
        self.take.then(|| self.seen.len() as u32 - 1)
    }
}

/// Parses with a claim, returning the document's rendering and what the claim saw.
fn claiming(bytes: &[u8], take: bool) -> (String, Vec<String>) {
    let mut rec = Recorder {
        take,
        seen: Vec::new(),
    };
    let doc = Document::parse_claiming(bytes, &Limits::default(), &mut |_, _| {}, &mut rec)
        .unwrap_or_else(|e| panic!("{e}"));
    (doc.repr(doc.root(), 1000), rec.seen)
}

/// Checks the reader's fast path for claimed dicts, which only protocols 4
/// and 5 reach (older ones memoize with explicit indices), against the
/// generic machine reading the same value pickled with protocol 2.
fn check_claims(value: Json) -> Result<(), TestCaseError> {
    let (old, _) = cpython(json!({"proto": 2, "value": value}));
    let (new, theirs) = cpython(json!({"proto": 4, "value": value}));
    // Declined dicts must be complete, exactly as CPython reads them.
    let (declined, offered_new) = claiming(&new, false);
    prop_assert_eq!(declined, theirs);
    let (_, offered_old) = claiming(&old, false);
    prop_assert_eq!(offered_new, offered_old);
    // Claimed dicts read as empty, the same way on both paths.
    prop_assert_eq!(claiming(&new, true), claiming(&old, true));
    Ok(())
}

/// Generates a trace whose entries' frames lists follow a repeating order,
/// as a training loop's do, with a few entries changed, lists that share a
/// prefix or differ only in length, and some entries that the fast path
/// gives up on after reading their list (an empty dict after it).
fn repeating_trace() -> impl Strategy<Value = Json> {
    let frame = "[a-z]{0,6}".prop_map(|n| json!({"d": [[{"k": "name"}, {"s": n}]]}));
    let template = proptest::collection::vec(0usize..6, 1..10);
    (
        proptest::collection::vec(frame, 1..6),
        proptest::collection::vec(template, 1..6),
        proptest::collection::vec(0usize..6, 1..8),
        1usize..6,
        proptest::collection::vec((0usize..48, 0usize..6, any::<bool>()), 0..6),
    )
        .prop_map(|(frames, mut templates, base, repeats, changes)| {
            let frames_len = frames.len();
            // A template extended by one frame: the same prefix, a different length.
            let mut longer = templates[0].clone();
            longer.push(0);
            templates.push(longer);
            let mut order: Vec<(usize, bool)> = (0..repeats)
                .flat_map(|_| base.iter().map(|&t| (t % templates.len(), false)))
                .collect();
            for (at, t, give_up) in changes {
                if let Some(slot) = order.get_mut(at) {
                    *slot = (t % templates.len(), give_up);
                }
            }
            let entries: Vec<Json> = order
                .iter()
                .enumerate()
                .map(|(n, &(t, give_up))| {
                    // Shared objects are numbered in the order they were built, so
                    // numbers below the frames' count are the frame dicts.
                    let list: Vec<Json> = templates[t]
                        .iter()
                        .map(|&f| json!({"share": f % frames_len}))
                        .collect();
                    let mut items = vec![
                        json!([{"k": "action"}, {"k": "alloc"}]),
                        json!([{"k": "size"}, {"i": n.to_string()}]),
                        json!([{"k": "frames"}, {"l": list}]),
                    ];
                    if give_up {
                        items.push(json!([{"k": "compile_context"}, {"d": []}]));
                    }
                    json!({"d": items})
                })
                .collect();
            json!({"l": [{"l": frames}, {"l": entries}]})
        })
}

/// Claims the dicts that have an `action` and numbers lists by their slots,
/// rendering each claimed dict with its lists spelled out, whether they
/// were claimed (by number) or not (by their items).
#[derive(Default)]
struct ListRecorder {
    seen: Vec<String>,
    lists: Vec<String>,
    numbers: HashMap<Vec<Slot>, u32>,
}

impl ListRecorder {
    fn render(&self, doc: &Document<'_>, s: Slot) -> String {
        let items = |v: &[Slot]| {
            v.iter()
                .map(|&x| doc.repr(x, 1000))
                .collect::<Vec<_>>()
                .join(",")
        };
        match (doc.claimed_list(s), doc.kind(s)) {
            (Some(n), _) => format!("[{}]", self.lists[n as usize]),
            (None, Some(Kind::List)) => format!("[{}]", items(doc.seq(s).unwrap_or(&[]))),
            _ => doc.repr(s, 1000),
        }
    }
}

impl Claim for ListRecorder {
    fn claim(&mut self, doc: &Document<'_>, items: &[Slot]) -> Option<u32> {
        if !items
            .chunks_exact(2)
            .any(|p| doc.as_str(p[0]) == Some("action"))
        {
            return None;
        }
        let rendered: Vec<String> = items.iter().map(|&s| self.render(doc, s)).collect();
        self.seen.push(rendered.join(","));
        Some(self.seen.len() as u32 - 1)
    }

    fn claim_list(&mut self, doc: &Document<'_>, items: &[Slot]) -> Option<u32> {
        if let Some(&n) = self.numbers.get(items) {
            return Some(n);
        }
        let n = self.lists.len() as u32;
        self.lists.push(
            items
                .iter()
                .map(|&x| doc.repr(x, 1000))
                .collect::<Vec<_>>()
                .join(","),
        );
        self.numbers.insert(items.to_vec(), n);
        Some(n)
    }
}

/// Checks that lists claimed on the fast path (found again by their bytes
/// or by the order they come in) get the number their items call for, by
/// comparing with the generic machine, which claims no list, reading the
/// same value pickled with protocol 2.
fn check_lists(value: Json) -> Result<(), TestCaseError> {
    let seen = |bytes: &[u8]| {
        let mut rec = ListRecorder::default();
        Document::parse_claiming(bytes, &Limits::default(), &mut |_, _| {}, &mut rec)
            .unwrap_or_else(|e| panic!("{e}"));
        rec.seen
    };
    let (old, _) = cpython(json!({"proto": 2, "value": value}));
    let (new, _) = cpython(json!({"proto": 4, "value": value}));
    let (old, new) = (seen(&old), seen(&new));
    prop_assert!(!new.is_empty());
    prop_assert_eq!(new, old);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn claimed_dicts_read_alike_on_both_paths(v in desc(2)) { check_claims(v)?; }
    #[test]
    fn claimed_trace_entries_read_alike_on_both_paths(v in trace_like()) { check_claims(v)?; }
    #[test]
    fn repeated_frames_lists_get_the_numbers_of_their_items(v in repeating_trace()) { check_lists(v)?; }
    #[test]
    fn protocol_2(v in desc(2)) { check(2, v)?; }
    #[test]
    fn protocol_3(v in desc(3)) { check(3, v)?; }
    #[test]
    fn protocol_4(v in desc(4)) { check(4, v)?; }
    #[test]
    fn protocol_5(v in desc(5)) { check(5, v)?; }
}

#[test]
fn shared_objects_stay_shared() {
    let (bytes, _) =
        cpython(json!({"proto": 4, "special": "(lambda f: [f, f, {'x': f}])({'name': 'fwd'})"}));
    let doc = Document::parse(&bytes).unwrap();
    let items = doc.seq(doc.root()).unwrap();
    assert_eq!(items[0], items[1], "both references must be one object");
    assert_eq!(doc.dict_get(items[2], "x"), Some(items[0]));
}

#[test]
fn cycles_and_recursive_tuples() {
    for expr in [
        "(lambda l: (l.append(l), l)[1])([])",
        "(lambda l: (l.append((l, 1, 2, 3)), (l, 'a'))[1])([])",
        "(lambda d: (d.__setitem__('self', d), d)[1])({})",
    ] {
        for proto in 2..=5 {
            let (bytes, theirs) = cpython(json!({"proto": proto, "special": expr}));
            assert_eq!(ours(&bytes), theirs, "{expr} at protocol {proto}");
        }
    }
}

#[test]
fn long1_wider_than_eight_bytes() {
    let (bytes, theirs) =
        cpython(json!({"proto": 4, "special": "[2**64, -2**64, 2**200 + 7, 2**60, -2**60 - 1]"}));
    assert_eq!(ours(&bytes), theirs);
    let doc = Document::parse(&bytes).unwrap();
    let items = doc.seq(doc.root()).unwrap();
    assert_eq!(doc.as_i128(items[0]), Some(1i128 << 64));
    assert_eq!(doc.as_i128(items[1]), Some(-(1i128 << 64)));
    assert_eq!(doc.as_i128(items[2]), None);
    assert_eq!(doc.as_i64(items[3]), Some(1 << 60));
    assert!(matches!(doc.value(items[2]), Value::BigInt(_)));
}

#[test]
fn strings_bytes_and_wide_integers_on_both_sides_of_the_short_span_limit() {
    // Up to 255 bytes a slot keeps the offset and length itself; longer
    // ones go to the span table. Both must read back the same, shared or not.
    // Bytes need protocol 3 and bytearray 5 to pickle without a GLOBAL.
    let expr = "(lambda s: [s, s, 'x' * 256, 'é' * 127, 'é' * 128, '', b'y' * 255, b'y' * 256, \
                2**64, -2**2000, {'k' * 255: 'v' * 256}, bytearray(b'z' * 300)])('a' * 255)";
    for proto in [4, 5] {
        let expr = if proto == 5 {
            expr.to_string()
        } else {
            expr.replace(", bytearray(b'z' * 300)", "")
        };
        let (bytes, theirs) = cpython(json!({"proto": proto, "special": expr}));
        assert_eq!(ours(&bytes), theirs, "protocol {proto}");
        let doc = Document::parse(&bytes).unwrap();
        let items = doc.seq(doc.root()).unwrap();
        assert_eq!(doc.as_str(items[0]), Some("a".repeat(255).as_str()));
        assert_eq!(items[0], items[1], "a memo reference is the same slot");
        assert_eq!(doc.as_str(items[2]), Some("x".repeat(256).as_str()));
        assert_eq!(doc.as_str(items[3]).map(str::len), Some(254));
        assert_eq!(doc.as_str(items[4]).map(str::len), Some(256));
        assert_eq!(doc.as_str(items[5]), Some(""));
    }
}

#[test]
fn refused_opcodes_name_themselves_and_their_offset() {
    let cases: &[(&str, &str)] = &[
        ("__import__('collections').OrderedDict(a=1)", "REDUCE"),
        ("__import__('fractions').Fraction(1, 3)", "REDUCE"),
        ("__import__('datetime').date(2020, 1, 1)", "REDUCE"),
        ("__import__('types').SimpleNamespace(a=1)", "REDUCE"),
    ];
    for (expr, _) in cases {
        for proto in 2..=5 {
            let (bytes, _) = cpython(json!({"proto": proto, "special": expr, "raw": true}));
            match Document::parse(&bytes) {
                Err(Error::Refused { name, offset, .. }) => {
                    assert!(
                        [
                            "GLOBAL",
                            "STACK_GLOBAL",
                            "REDUCE",
                            "NEWOBJ",
                            "BUILD",
                            "NEWOBJ_EX"
                        ]
                        .contains(&name),
                        "{name}"
                    );
                    let op = bytes[offset as usize];
                    assert!(
                        matches!(op, b'c' | 0x93 | b'R' | 0x81 | b'b' | 0x92),
                        "offset {offset} holds 0x{op:02x}"
                    );
                }
                other => panic!(
                    "{expr} at {proto}: expected a refusal, got {:?}",
                    other.map(|_| ())
                ),
            }
        }
    }
}
