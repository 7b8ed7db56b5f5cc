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
    Document::parse_claiming(data, &Limits::default(), &mut |_| {}, claim)
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
