//! A safe, zero-copy reader for Python pickle data.
//!
//! PyTorch memory snapshots are plain pickles of dicts, lists, strings and
//! numbers. This crate reads protocols 2 to 5 into a flat arena without ever
//! importing, calling or building a Python object: every opcode that could
//! do so (`GLOBAL`, `REDUCE`, `BUILD`, `INST`, `OBJ`, `NEWOBJ`, `PERSID`, ...)
//! is refused with an error naming the opcode and its byte offset.
//!
//! The reader is an iterative stack machine, so hostile input cannot exhaust
//! the native stack, and its memory is bounded by [`Limits`]. Strings and
//! bytes are borrowed from the input, which is normally a memory map
//! ([`Source`]). Objects that the pickle shares through its memo stay shared:
//! two references to one list are the same [`Slot`].
//!
//! ```
//! use oomkit_pickle::{Document, Value};
//! // pickle.dumps({"a": [1, 2]}, protocol=4)
//! let data = b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01a\x94]\x94(K\x01K\x02es.";
//! let doc = Document::parse(data).unwrap();
//! let list = doc.dict_get(doc.root(), "a").unwrap();
//! assert_eq!(doc.seq(list).unwrap().len(), 2);
//! assert!(matches!(doc.value(doc.seq(list).unwrap()[1]), Value::Int(2)));
//! ```

mod error;
mod pager;
mod parse;
mod repr;
pub use repr::REPR_MAX_VALUES;
mod source;
mod value;

pub use error::{Error, Result};
pub use pager::{Ahead, Pager, PAGER_MIN};
pub use parse::{Claim, Limits};
pub use source::{advise_huge_pages, Source};
pub use value::{Document, Kind, Slot, Value};
