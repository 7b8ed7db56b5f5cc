//! Page handling beside a parse: the file's pages mapped ahead of the parser
//! and released behind it, and fresh tables faulted in before they are filled.
//!
//! The first touch of a page is a fault in the kernel: mapping a cached page
//! of the file, or zeroing a fresh one for a table. A large snapshot's parse
//! touches every page of the file and tens of megabytes of tables, and on one
//! core those faults are a large part of its time. `MADV_POPULATE_READ` and
//! `MADV_POPULATE_WRITE` take the same faults without reading or writing a
//! byte, so a helper thread on another core can take them a little ahead of
//! the parser, while also releasing the pages it has left behind.

use crate::source::Source;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

/// Page size assumed for rounding; the kernel rounds to its own as well.
const PAGE: usize = 4096;
/// Smallest mapped file for which a [`Pager`] runs a helper thread.
pub const PAGER_MIN: usize = 32 << 20;
/// How far past the parser the helper maps the file.
const READ_AHEAD: usize = 3 << 20;
/// How far behind the parser pages stay mapped, so that the strings of the
/// structure being read are not faulted in twice.
const KEEP_BEHIND: usize = 256 << 10;
/// Most table ranges one step can name.
const MAX_TABLES: usize = 4;

/// Ranges of tables that a parse is about to fill, by address.
#[derive(Clone, Copy, Default)]
pub struct Ahead {
    ranges: [(usize, usize); MAX_TABLES],
    n: usize,
}

impl Ahead {
    /// Names up to `bytes` of `v`'s spare capacity as about to be filled.
    ///
    /// Only whole pages past the one in use count, and only within the
    /// capacity, so a pager never touches memory the vector has not reserved.
    pub fn add<T>(&mut self, v: &Vec<T>, bytes: usize) {
        if self.n == MAX_TABLES {
            return;
        }
        let size = std::mem::size_of::<T>();
        let base = v.as_ptr() as usize;
        let used = (base + v.len() * size).next_multiple_of(PAGE);
        let end = (base + v.capacity() * size).min(used + bytes) / PAGE * PAGE;
        if end > used {
            self.ranges[self.n] = (used, end);
            self.n += 1;
        }
    }
}

/// What the helper thread is asked to do next: only the latest step counts.
#[derive(Default)]
struct Mailbox {
    step: Option<(usize, Ahead)>,
    done: bool,
}

/// Maps a file's pages ahead of a parse and releases them behind it,
/// faulting in the parse's tables too where a helper thread runs.
///
/// Made by [`Source::paged`]. For a small file, or an input that is not a
/// memory map, there is no helper and the pager only releases pages behind
/// the parser, on the caller's thread.
pub struct Pager<'s> {
    source: &'s Source,
    mailbox: Mutex<Mailbox>,
    ready: Condvar,
    /// Whether a helper thread serves the mailbox.
    helped: AtomicBool,
    /// Bytes of the file released so far, where no helper runs.
    released: AtomicUsize,
}

impl Source {
    /// Runs `f` with a [`Pager`] for this input, which `f` should tell where
    /// the parse stands every step (see [`crate::Document::parse_claiming`]).
    ///
    /// The helper thread, where there is one, lives only inside this call,
    /// so it can never touch the map after the source is gone.
    pub fn paged<R>(&self, f: impl FnOnce(&Pager<'_>) -> R) -> R {
        let pager = Pager {
            source: self,
            mailbox: Mutex::new(Mailbox::default()),
            ready: Condvar::new(),
            helped: AtomicBool::new(false),
            released: AtomicUsize::new(0),
        };
        if !matches!(self, Source::Mapped(_)) || self.bytes().len() < PAGER_MIN {
            return f(&pager);
        }
        std::thread::scope(|scope| {
            // Without a helper the parse still runs; it takes its own faults.
            let helped = std::thread::Builder::new()
                .name("oomkit-pager".into())
                .spawn_scoped(scope, || pager.serve())
                .is_ok();
            pager.helped.store(helped, Ordering::Relaxed);
            // The helper must hear that the parse is over even if `f`
            // unwinds, or the scope would wait for it forever.
            let _finish = Finish(&pager);
            f(&pager)
        })
    }
}

impl Pager<'_> {
    /// Tells the pager that the parse has read up to `pos` and is about to
    /// fill `ahead`.
    pub fn advanced(&self, pos: usize, ahead: &Ahead) {
        if self.helped.load(Ordering::Relaxed) {
            let mut m = self.mailbox.lock().unwrap_or_else(|e| e.into_inner());
            m.step = Some((pos, *ahead));
            self.ready.notify_one();
        } else {
            let released = self.release_behind(self.released.load(Ordering::Relaxed), pos);
            self.released.store(released, Ordering::Relaxed);
        }
    }

    /// Releases the file's pages from `released` up to a little behind
    /// `pos`, returning how far the file is released now.
    fn release_behind(&self, released: usize, pos: usize) -> usize {
        let upto = pos.saturating_sub(KEEP_BEHIND);
        if upto <= released {
            return released;
        }
        self.source.release(released, upto);
        upto
    }

    /// Ends the helper thread's loop once its current step is done.
    fn finish(&self) {
        self.mailbox.lock().unwrap_or_else(|e| e.into_inner()).done = true;
        self.ready.notify_one();
    }

    /// The helper thread: takes the latest step, releases behind it, and
    /// faults in what lies ahead of it.
    fn serve(&self) {
        let bytes = self.source.bytes();
        let base = bytes.as_ptr() as usize;
        let (mut released, mut mapped) = (0, 0);
        loop {
            let (pos, ahead) = {
                let mut m = self.mailbox.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if m.done {
                        return;
                    }
                    if let Some(step) = m.step.take() {
                        break step;
                    }
                    m = self.ready.wait(m).unwrap_or_else(|e| e.into_inner());
                }
            };
            // Releasing only here, never on the parser's thread, means a page
            // mapped ahead is released at most once and never mapped again.
            released = self.release_behind(released, pos);
            let from = mapped.max(pos);
            let to = (pos + READ_AHEAD).min(bytes.len());
            if to > from {
                populate(base + from, base + to, libc::MADV_POPULATE_READ);
                mapped = to;
            }
            for &(start, end) in &ahead.ranges[..ahead.n] {
                populate(start, end, libc::MADV_POPULATE_WRITE);
            }
        }
    }
}

/// Ends a pager's helper thread when dropped.
struct Finish<'p, 's>(&'p Pager<'s>);

impl Drop for Finish<'_, '_> {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// Faults in the pages of `[start, end)` with a populate advice.
fn populate(start: usize, end: usize, advice: libc::c_int) {
    let start = start / PAGE * PAGE;
    if end > start {
        // SAFETY: the populate advices fault pages in as a read or a write
        // would, without changing a byte of them, so they cannot disturb
        // memory the parser or anything else is using. A range that is no
        // longer mapped, or mapped read-only, gets an error, ignored here.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, advice);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ahead_names_whole_pages_of_spare_capacity_only() {
        let mut v: Vec<u64> = Vec::with_capacity(10 * PAGE);
        v.resize(100, 0);
        let mut ahead = Ahead::default();
        ahead.add(&v, 3 * PAGE);
        let (start, end) = ahead.ranges[0];
        let base = v.as_ptr() as usize;
        assert_eq!(ahead.n, 1);
        assert_eq!((start % PAGE, end % PAGE), (0, 0));
        assert!(start >= base + 100 * 8, "the page in use is left alone");
        assert!(end <= (base + 100 * 8).next_multiple_of(PAGE) + 3 * PAGE);
        // A full vector has nothing ahead, and a fifth table is dropped.
        let full: Vec<u64> = vec![0; 1000];
        let mut ahead = Ahead::default();
        ahead.add(&full, 1 << 20);
        assert_eq!(ahead.n, 0);
        for _ in 0..MAX_TABLES + 1 {
            ahead.add(&v, PAGE * 2);
        }
        assert_eq!(ahead.n, MAX_TABLES);
    }

    /// A mapped file past the threshold, full of zeros, and its path.
    fn big_file(tag: &str) -> (std::path::PathBuf, Source) {
        let path = std::env::temp_dir().join(format!("oomkit-pager-{tag}-{}", std::process::id()));
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(PAGER_MIN as u64 + (3 << 20)).unwrap();
        let src = Source::open(&path).unwrap();
        assert!(matches!(src, Source::Mapped(_)));
        (path, src)
    }

    #[test]
    fn a_helper_serves_the_steps_and_the_bytes_read_stay_the_same() {
        let (path, src) = big_file("steps");
        let mut table: Vec<u32> = Vec::with_capacity(1 << 20);
        let sum = src.paged(|pager| {
            let bytes = src.bytes();
            let mut sum = 0u64;
            for (i, chunk) in bytes.chunks(1 << 20).enumerate() {
                sum += chunk.iter().map(|&b| b as u64).sum::<u64>();
                table.extend(std::iter::repeat_n(i as u32, 1000));
                let mut ahead = Ahead::default();
                ahead.add(&table, 1 << 20);
                pager.advanced((i + 1) << 20, &ahead);
            }
            // Pages released behind read back as they were.
            sum + bytes[..1 << 20].iter().map(|&b| b as u64).sum::<u64>()
        });
        assert_eq!(sum, 0);
        assert_eq!(table.len(), 1000 * src.bytes().len().div_ceil(1 << 20));
        assert!(table
            .chunks(1000)
            .enumerate()
            .all(|(i, c)| c.iter().all(|&x| x == i as u32)));
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_panic_inside_ends_the_helper_instead_of_hanging() {
        let (path, src) = big_file("panic");
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            src.paged(|pager| {
                pager.advanced(1 << 20, &Ahead::default());
                panic!("the parse failed");
            })
        }));
        assert!(caught.is_err());
        std::fs::remove_file(path).unwrap();
    }
}
