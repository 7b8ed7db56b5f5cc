//! Input bytes: a read-only memory map of a file, or an owned buffer.

use crate::error::{Error, Result};
use memmap2::{Advice, Mmap, UncheckedAdvice};
use std::fs::File;
use std::io::Read;
use std::path::Path;

/// The bytes of a pickle file, mapped when possible.
pub enum Source {
    /// A read-only memory map of a regular file.
    Mapped(Mmap),
    /// Bytes read into memory, for pipes and other unmappable inputs.
    Owned(Vec<u8>),
}

impl Source {
    /// Opens a file, mapping it read-only, or reading it where it cannot be mapped.
    pub fn open(path: &Path) -> Result<Source> {
        let io = |source| Error::Io {
            path: path.display().to_string(),
            source,
        };
        let mut file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if meta.is_dir() {
            return Err(io(std::io::Error::other("is a directory")));
        }
        if meta.is_file() && meta.len() > 0 {
            // SAFETY: the map is read-only and private; oomkit never writes to
            // the file. A concurrent truncation by another process would
            // raise SIGBUS, the documented risk every mmap-based reader takes.
            if let Ok(map) = unsafe { Mmap::map(&file) } {
                let _ = map.advise(Advice::Sequential);
                return Ok(Source::Mapped(map));
            }
        }
        let mut buf = Vec::new();
        file.read_to_end(&mut buf).map_err(io)?;
        Ok(Source::Owned(buf))
    }

    /// Returns the whole input.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Source::Mapped(m) => m,
            Source::Owned(v) => v,
        }
    }

    /// Drops the resident pages of `[start, end)` so that a sequential
    /// reader's resident memory does not grow with the file.
    ///
    /// The pages stay readable: the kernel refills them from the page cache
    /// on the next access, which is why borrowed strings remain valid.
    pub fn release(&self, start: usize, end: usize) {
        if let Source::Mapped(m) = self {
            let page = 4096;
            let start = start / page * page;
            let end = (end / page * page).min(m.len());
            if end > start {
                // SAFETY: the mapping is a private read-only map of a file
                // that was never written through it, so discarding pages
                // loses nothing: they are read back from the file on access.
                let _ = unsafe {
                    m.unchecked_advise_range(UncheckedAdvice::DontNeed, start, end - start)
                };
            }
        }
    }
}

/// Asks the kernel to back a large vector's reserved capacity with huge pages.
///
/// The tables of a large snapshot grow to tens of megabytes a few bytes at a
/// time, and with 4 KiB pages each first touch of a page is a fault: a fifth
/// of the whole run. This is only advice: the kernel may ignore it, and
/// nothing but speed depends on it.
pub fn advise_huge_pages<T>(v: &Vec<T>) {
    const HUGE: usize = 2 << 20;
    let start = v.as_ptr() as usize;
    let end = start + v.capacity() * std::mem::size_of::<T>();
    let (start, end) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
    if end > start {
        // SAFETY: the range lies inside the vector's own allocation, and
        // MADV_HUGEPAGE changes how its pages are backed, never their contents.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}
