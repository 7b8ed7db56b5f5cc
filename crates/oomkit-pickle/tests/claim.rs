//! Dicts taken over by a `Claim` while parsing.

use oomkit_pickle::{Claim, Document, Error, Kind, Limits, Slot};

/// Claims every dict that has an `action` key, numbering them in order.
#[derive(Default)]
struct Actions {
    seen: Vec<(String, i64)>,
    offered: usize,
}

impl Claim for Actions {
    fn claim(&mut self, doc: &Document<'_>, items: &[Slot]) -> Option<u32> {
        self.offered += 1;
        let get = |key: &str| {
            items
                .chunks_exact(2)
                .find(|p| doc.as_str(p[0]) == Some(key))
                .map(|p| p[1])
        };
        let action = doc.as_str(get("action")?)?.to_string();
        let n = doc.as_i64(get("n")?)?;
        self.seen.push((action, n));
        Some(self.seen.len() as u32 - 1)
    }
}

fn parse_claiming<'a>(data: &'a [u8], claim: &mut Actions) -> oomkit_pickle::Result<Document<'a>> {
    Document::parse_claiming(data, &Limits::default(), &mut |_, _| {}, claim)
}

/// pickle.dumps([{'action':'alloc','n':1},{'x':2},{'action':'free','n':3}], protocol=4)
const LIST: &[u8] = b"\x80\x04\x95:\x00\x00\x00\x00\x00\x00\x00]\x94(}\x94(\x8c\x06action\x94\x8c\x05alloc\x94\x8c\x01n\x94K\x01u}\x94\x8c\x01x\x94K\x02s}\x94(h\x02\x8c\x04free\x94h\x04K\x03ue.";

#[test]
fn claimed_dicts_read_as_empty_and_keep_their_number() {
    let mut claim = Actions::default();
    let doc = parse_claiming(LIST, &mut claim).unwrap();
    assert_eq!(
        claim.seen,
        vec![("alloc".to_string(), 1), ("free".to_string(), 3)]
    );
    let items = doc.seq(doc.root()).unwrap();
    assert_eq!(items.len(), 3);
    assert_eq!(doc.claimed(items[0]), Some(0));
    assert_eq!(doc.claimed(items[2]), Some(1));
    assert_eq!(doc.kind(items[0]), Some(Kind::Dict));
    assert_eq!(doc.items(items[0]), Some(&[][..]));
    // A one-item dict arrives through SETITEM, which the claim is not offered.
    assert_eq!(doc.claimed(items[1]), None);
    assert_eq!(doc.as_i64(doc.dict_get(items[1], "x").unwrap()), Some(2));
    assert_eq!(claim.offered, 2);
}

#[test]
fn without_a_claim_the_same_pickle_keeps_every_dict() {
    let doc = Document::parse(LIST).unwrap();
    let items = doc.seq(doc.root()).unwrap();
    assert!(items.iter().all(|&d| doc.claimed(d).is_none()));
    assert_eq!(
        doc.as_str(doc.dict_get(items[2], "action").unwrap()),
        Some("free")
    );
}

#[test]
fn adding_to_a_claimed_dict_later_is_malformed() {
    // protocol 2: d = {'action': 'a', 'n': 1} claimed at SETITEMS, then
    // fetched from the memo and given another item.
    let data = b"\x80\x02}q\x00(X\x06\x00\x00\x00actionX\x01\x00\x00\x00aX\x01\x00\x00\x00nK\x01u0h\x00X\x01\x00\x00\x00zK\x02s.";
    let doc = Document::parse(data).unwrap();
    assert_eq!(doc.dict_items(doc.root()).unwrap().count(), 3);
    let mut claim = Actions::default();
    match parse_claiming(data, &mut claim) {
        Err(Error::Malformed { offset, reason }) => {
            assert!(reason.contains("after it was complete"), "{reason}");
            assert_eq!(offset as usize, data.len() - 2);
        }
        other => panic!("expected malformed, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn full_batches_are_not_offered() {
    // A dict of 1,000 pairs may be followed by another SETITEMS batch.
    let mut data = b"\x80\x02}q\x00(".to_vec();
    data.extend_from_slice(b"X\x06\x00\x00\x00actionX\x01\x00\x00\x00aX\x01\x00\x00\x00nK\x01");
    for i in 0..998u16 {
        data.push(b'M');
        data.extend_from_slice(&i.to_le_bytes());
        data.extend_from_slice(b"K\x00");
    }
    data.extend_from_slice(b"u.");
    let mut claim = Actions::default();
    let doc = parse_claiming(&data, &mut claim).unwrap();
    assert_eq!(claim.offered, 0);
    assert_eq!(doc.dict_items(doc.root()).unwrap().count(), 1000);
}

/// Claims dicts with an `action` like [`Actions`], and lists of exactly two
/// items, recording the list number each claimed dict's `frames` had.
#[derive(Default)]
struct WithLists {
    frames: Vec<(i64, Option<u32>, usize)>,
    lists: u32,
}

impl Claim for WithLists {
    fn claim(&mut self, doc: &Document<'_>, items: &[Slot]) -> Option<u32> {
        let get = |key: &str| {
            items
                .chunks_exact(2)
                .find(|p| doc.as_str(p[0]) == Some(key))
                .map(|p| p[1])
        };
        let frames = get("frames")?;
        let n = doc.as_i64(get("n")?)?;
        let left = doc.seq(frames).map_or(0, |s| s.len());
        self.frames.push((n, doc.claimed_list(frames), left));
        Some(self.frames.len() as u32 - 1)
    }

    fn claim_list(&mut self, _doc: &Document<'_>, items: &[Slot]) -> Option<u32> {
        (items.len() == 2).then(|| {
            self.lists += 1;
            self.lists - 1
        })
    }
}

#[test]
fn claimed_lists_keep_their_identity_and_read_as_empty() {
    // f = {'filename': 'a.py', 'line': 1, 'name': 'f'}; frames = [f, f]
    // pickle.dumps([f, {'action': 'alloc', 'n': 1, 'frames': frames},
    //               {'action': 'free', 'n': 2, 'frames': frames},
    //               {'action': 'x', 'n': 3, 'frames': [f, f, f]}, frames], protocol=4)
    let data = b"\x80\x04\x95\x8c\x00\x00\x00\x00\x00\x00\x00]\x94(}\x94(\x8c\x08filename\x94\x8c\x04a.py\x94\x8c\x04line\x94K\x01\x8c\x04name\x94\x8c\x01f\x94u}\x94(\x8c\x06action\x94\x8c\x05alloc\x94\x8c\x01n\x94K\x01\x8c\x06frames\x94]\x94(h\x01h\x01eu}\x94(h\x08\x8c\x04free\x94h\x0aK\x02h\x0bh\x0cu}\x94(h\x08\x8c\x01x\x94h\x0aK\x03h\x0b]\x94(h\x01h\x01h\x01euh\x0ce.";
    let mut claim = WithLists::default();
    let doc =
        Document::parse_claiming(data, &Limits::default(), &mut |_, _| {}, &mut claim).unwrap();
    // The two entries share one claimed list through the memo; the
    // three-item list was declined and keeps its items.
    assert_eq!(
        claim.frames,
        vec![(1, Some(0), 0), (2, Some(0), 0), (3, None, 3)]
    );
    assert_eq!(claim.lists, 1);
    let root = doc.seq(doc.root()).unwrap();
    assert_eq!(root.len(), 5);
    let list = root[4];
    assert_eq!(doc.claimed_list(list), Some(0));
    assert_eq!(doc.claimed(list), None);
    assert_eq!(doc.kind(list), Some(Kind::List));
    assert_eq!(doc.seq(list), Some(&[][..]));
    assert_eq!(doc.claimed(root[1]), Some(0));
    assert_eq!(doc.claimed_list(root[1]), None);
    // The frame dict itself is not a list and stays whole.
    assert_eq!(
        doc.as_str(doc.dict_get(root[0], "name").unwrap()),
        Some("f")
    );
    // Without a claim, every list keeps its items.
    let plain = Document::parse(data).unwrap();
    let root = plain.seq(plain.root()).unwrap();
    assert_eq!(plain.seq(root[4]).map(|s| s.len()), Some(2));
}

#[test]
fn adding_to_a_claimed_list_later_is_malformed() {
    // {'n': 1, 'frames': ['n', 'n']}: the claimed list is fetched from the
    // memo and appended to.
    let data = b"\x80\x04}\x94(\x8c\x01n\x94K\x01\x8c\x06frames\x94]\x94(h\x01h\x01eu0h\x03K\x07a.";
    let mut claim = WithLists::default();
    match Document::parse_claiming(data, &Limits::default(), &mut |_, _| {}, &mut claim) {
        Err(Error::Malformed { reason, .. }) => {
            assert!(reason.contains("list after it was complete"), "{reason}")
        }
        other => panic!("expected malformed, got {:?}", other.map(|_| ())),
    }
    assert!(Document::parse(data).is_ok());
}

/// f = {'filename': 'a.py', 'line': 1, 'name': 'f'}
/// pickle.dumps([f, {'action': 'a', 'n': 1, 'frames': [f, f]},
///               {'action': 'a', 'n': 2, 'frames': [f, f]}], protocol=4):
/// two lists written apart with the same bytes.
const TWO_LISTS: &[u8] = b"\x80\x04\x95m\x00\x00\x00\x00\x00\x00\x00]\x94(}\x94(\x8c\x08filename\x94\x8c\x04a.py\x94\x8c\x04line\x94K\x01\x8c\x04name\x94\x8c\x01f\x94u}\x94(\x8c\x06action\x94\x8c\x01a\x94\x8c\x01n\x94K\x01\x8c\x06frames\x94]\x94(h\x01h\x01eu}\x94(h\x08h\x09h\x0aK\x02h\x0b]\x94(h\x01h\x01eue.";

#[test]
fn a_list_with_the_bytes_of_a_claimed_one_gets_its_number_unasked() {
    let mut claim = WithLists::default();
    Document::parse_claiming(TWO_LISTS, &Limits::default(), &mut |_, _| {}, &mut claim).unwrap();
    assert_eq!(claim.frames, vec![(1, Some(0), 0), (2, Some(0), 0)]);
    assert_eq!(claim.lists, 1, "the second list was not offered");
}

#[test]
fn a_replaced_memo_cell_makes_the_same_bytes_be_asked_again() {
    // Between the entries, `N q\x01 0` stores None in memo cell 1 (the
    // frame dict), so the second list's bytes now mean [None, None].
    let split = TWO_LISTS.windows(2).rposition(|w| w == b"u}").unwrap() + 1;
    let mut data = TWO_LISTS[..split].to_vec();
    data.extend_from_slice(b"Nq\x010");
    data.extend_from_slice(&TWO_LISTS[split..]);
    let mut claim = WithLists::default();
    let doc =
        Document::parse_claiming(&data, &Limits::default(), &mut |_, _| {}, &mut claim).unwrap();
    assert_eq!(claim.frames, vec![(1, Some(0), 0), (2, Some(1), 0)]);
    assert_eq!(claim.lists, 2);
    assert!(matches!(
        doc.value(doc.seq(doc.root()).unwrap()[0]),
        oomkit_pickle::Value::Container(Kind::Dict)
    ));
}

#[test]
fn frames_inside_a_dict_or_a_list_body_keep_the_fast_path() {
    // The pickler starts a frame before any object once the current one is
    // full, so in a large file frames fall inside dicts and list bodies.
    const FRAME: &[u8] = b"\x95\x00\x00\x00\x00\x00\x00\x00\x00";
    let second = TWO_LISTS.windows(2).rposition(|w| w == b"u}").unwrap() + 1;
    let in_dict = second + b"}\x94(h\x08h\x09".len();
    let in_list = TWO_LISTS.len() - b"h\x01eue.".len();
    let mut data = TWO_LISTS[..in_dict].to_vec();
    data.extend_from_slice(FRAME);
    data.extend_from_slice(&TWO_LISTS[in_dict..in_list]);
    data.extend_from_slice(FRAME);
    data.extend_from_slice(&TWO_LISTS[in_list..]);
    let mut claim = WithLists::default();
    Document::parse_claiming(&data, &Limits::default(), &mut |_, _| {}, &mut claim).unwrap();
    // The second list is still claimed, though its bytes, with a frame
    // inside, are no longer those of the first and so it is offered again.
    assert_eq!(claim.frames, vec![(1, Some(0), 0), (2, Some(1), 0)]);
    assert_eq!(claim.lists, 2);

    // A frame inside a dict that runs past the input is reported as the
    // generic machine reports it.
    let mut bad = TWO_LISTS[..in_dict].to_vec();
    bad.extend_from_slice(b"\x95\xff\x00\x00\x00\x00\x00\x00\x00");
    bad.extend_from_slice(&TWO_LISTS[in_dict..]);
    let mut claim = WithLists::default();
    match Document::parse_claiming(&bad, &Limits::default(), &mut |_, _| {}, &mut claim) {
        Err(Error::Truncated { what, .. }) => assert!(what.contains("FRAME"), "{what}"),
        other => panic!("expected truncated, got {:?}", other.map(|_| ())),
    }
}
