//! Hostile and damaged input: every case must be a clean error with an offset.

use oomkit_pickle::{Document, Error, Limits};
use proptest::prelude::*;

/// pickle.dumps({'segments': [{'a': 1, 'frames': [{'line': 2}]}], 'x': 2**70}, protocol=4)
const GOOD: &[u8] = b"\x80\x04\x95D\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x08segments\x94]\x94}\x94(\x8c\x01a\x94K\x01\x8c\x06frames\x94]\x94}\x94\x8c\x04line\x94K\x02saua\x8c\x01x\x94\x8a\t\x00\x00\x00\x00\x00\x00\x00\x00@u.";

#[test]
fn the_sample_is_valid() {
    let doc = Document::parse(GOOD).unwrap();
    assert_eq!(doc.protocol(), 4);
    assert_eq!(
        doc.as_i128(doc.dict_get(doc.root(), "x").unwrap()),
        Some(1 << 70)
    );
}

#[test]
fn every_prefix_is_truncated() {
    for end in 0..GOOD.len() {
        match Document::parse(&GOOD[..end]) {
            Err(Error::Truncated { offset, .. }) => assert!(offset as usize <= end),
            Err(e) => panic!("prefix {end}: expected truncation, got {e}"),
            Ok(_) => panic!("prefix {end} parsed"),
        }
    }
}

#[test]
fn code_opcodes_are_refused_with_name_and_offset() {
    let cases: &[(&[u8], &str, u64)] = &[
        (
            b"\x80\x02cos\nsystem\n(S'touch /tmp/pwned'\ntR.",
            "GLOBAL",
            2,
        ),
        (b"\x80\x04\x8c\x02os\x8c\x06system\x93.", "STACK_GLOBAL", 14),
        (b"\x80\x02N)R.", "REDUCE", 4),
        (b"\x80\x02}}b.", "BUILD", 4),
        (b"(ios\nsystem\n.", "INST", 1),
        (b"(N)o.", "OBJ", 3),
        (b"\x80\x02N)\x81.", "NEWOBJ", 4),
        (b"\x80\x04N)}\x92.", "NEWOBJ_EX", 5),
        (b"Pabc\n.", "PERSID", 0),
        (b"NQ.", "BINPERSID", 1),
        (b"\x80\x02\x82\x01.", "EXT1", 2),
        (b"\x80\x02\x83\x01\x00.", "EXT2", 2),
        (b"\x80\x02\x84\x01\x00\x00\x00.", "EXT4", 2),
        (b"\x80\x05\x97.", "NEXT_BUFFER", 2),
        (b"\x80\x05N\x98.", "READONLY_BUFFER", 3),
    ];
    for (bytes, want, at) in cases {
        match Document::parse(bytes) {
            Err(Error::Refused { name, offset, .. }) => {
                assert_eq!((name, offset), (*want, *at), "{bytes:?}");
            }
            other => panic!("{want}: {:?}", other.map(|_| ()).map_err(|e| e.to_string())),
        }
    }
}

#[test]
fn garbage_and_empty_input() {
    assert!(matches!(
        Document::parse(b""),
        Err(Error::Truncated { offset: 0, .. })
    ));
    // A PNG header starts with NEWFALSE then PERSID.
    assert!(matches!(
        Document::parse(b"\x89PNG\r\n"),
        Err(Error::Refused {
            name: "PERSID",
            offset: 1,
            ..
        })
    ));
    assert!(matches!(
        Document::parse(b"\x7fELF"),
        Err(Error::UnknownOpcode {
            byte: 0x7f,
            offset: 0
        })
    ));
    match Document::parse(b"{\"json\": true}") {
        Err(Error::UnknownOpcode { offset: 0, .. }) | Err(Error::Malformed { offset: 0, .. }) => {}
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert!(matches!(
        Document::parse(b"\x80\x09N."),
        Err(Error::Malformed { offset: 0, .. })
    ));
}

#[test]
fn structural_errors() {
    // APPEND with nothing to append to
    assert!(matches!(
        Document::parse(b"Na."),
        Err(Error::Malformed { .. })
    ));
    // memo read before any write
    assert!(matches!(
        Document::parse(b"h\x05."),
        Err(Error::Malformed { .. })
    ));
    // SETITEMS on a list
    assert!(matches!(
        Document::parse(b"](NNu."),
        Err(Error::Malformed { .. })
    ));
    // STOP on an empty stack
    assert!(matches!(
        Document::parse(b"."),
        Err(Error::Malformed { .. })
    ));
    // a string that is not UTF-8
    assert!(matches!(
        Document::parse(b"\x8c\x01\xff."),
        Err(Error::Malformed { .. })
    ));
    // a length far past the end
    assert!(matches!(
        Document::parse(b"X\xff\xff\xff\x7f"),
        Err(Error::Truncated { .. })
    ));
    assert!(matches!(
        Document::parse(b"\x8d\xff\xff\xff\xff\xff\xff\xff\xff"),
        Err(Error::Truncated { .. })
    ));
    // a huge memo index must not allocate gigabytes
    let doc = Document::parse(b"Nr\xff\xff\xff\xff0j\xff\xff\xff\xff.").unwrap();
    assert!(doc.as_str(doc.root()).is_none());
}

#[test]
fn nesting_is_bounded() {
    let mut deep = vec![b'('; 20_000];
    deep.push(b'.');
    match Document::parse(&deep) {
        Err(Error::Limit { offset, what }) => {
            assert_eq!(offset, 10_000);
            assert!(what.contains("MARK"), "{what}");
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    // Deep nesting without marks parses (the machine is iterative), and the
    // canonical walk stops at its depth limit instead of overflowing.
    let mut chain = b"]".repeat(100_000);
    chain.extend(b"a".repeat(99_999));
    chain.push(b'.');
    let doc = Document::parse(&chain).unwrap();
    let text = doc.repr(doc.root(), 50);
    assert_eq!(text, format!("{}...{}", "[".repeat(50), "]".repeat(50)));
}

/// A pickle of `levels` nested lists, each holding the one below `fanout`
/// times through the memo: a few hundred bytes whose text has
/// `fanout^levels` leaves.
pub(crate) fn shared_lists(levels: u8, fanout: usize) -> Vec<u8> {
    let mut p = b"\x80\x02]q\x000".to_vec();
    for i in 1..=levels {
        p.extend([b']', b'q', i, b'(']);
        for _ in 0..fanout {
            p.extend([b'h', i - 1]);
        }
        p.push(b'e');
        if i < levels {
            p.push(b'0');
        }
    }
    p.push(b'.');
    p
}

#[test]
fn text_of_shared_containers_is_bounded() {
    // 10^12 leaves in about 300 bytes: the walk stops after REPR_MAX_VALUES values.
    let bytes = shared_lists(12, 10);
    assert!(bytes.len() < 400);
    let doc = Document::parse(&bytes).unwrap();
    let text = doc.repr(doc.root(), 64);
    assert!(text.starts_with("[[[[") && text.contains("..."));
    assert!(
        text.len() < 4 * oomkit_pickle::REPR_MAX_VALUES,
        "{}",
        text.len()
    );
    // Below the budget the text is whole.
    let bytes = shared_lists(3, 2);
    let small = Document::parse(&bytes).unwrap();
    assert_eq!(
        small.repr(small.root(), 64),
        "[[[[],[]],[[],[]]],[[[],[]],[[],[]]]]"
    );
}

#[test]
fn memory_is_bounded() {
    // 1 MB of DUP on an empty list: each byte asks for a stack cell.
    let mut dup = b"]".to_vec();
    dup.extend(std::iter::repeat_n(b'2', 1 << 20));
    dup.push(b'.');
    let limits = Limits {
        max_cells: Some(1000),
        ..Limits::default()
    };
    assert!(matches!(
        Document::parse_with(&dup, &limits, &mut |_, _| {}),
        Err(Error::Limit { .. })
    ));
    let limits = Limits {
        max_stack: 5000,
        ..Limits::default()
    };
    assert!(matches!(
        Document::parse_with(&dup, &limits, &mut |_, _| {}),
        Err(Error::Limit { offset: 5000, .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]
    /// Arbitrary bytes never panic, and errors point inside the input.
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Err(e) = Document::parse(&bytes) {
            prop_assert!(e.offset().unwrap() as usize <= bytes.len());
        }
    }

    /// Mutations of a valid pickle never panic.
    #[test]
    fn mutated_pickles_never_panic(edits in proptest::collection::vec((0usize..GOOD.len(), any::<u8>()), 1..6)) {
        let mut bytes = GOOD.to_vec();
        for (i, b) in edits { bytes[i] = b; }
        if let Ok(doc) = Document::parse(&bytes) {
            let _ = doc.repr(doc.root(), 100);
        }
    }
}
