//! A fast hash for the integer keys the reader and the replay use.

use std::hash::{BuildHasher, Hasher};

/// Builds [`FastHasher`]s: for addresses and arena slots, which are integers
/// the program made or read, SipHash's resistance to chosen keys buys nothing
/// and costs a third of the replay's time.
#[derive(Clone, Copy, Debug, Default)]
pub struct FastState;

/// A multiply-and-fold hasher in the manner of rustc's FxHasher.
#[derive(Clone, Copy, Debug, Default)]
pub struct FastHasher(u64);

const SEED: u64 = 0xf135_7aea_2e62_a9c5;

impl BuildHasher for FastState {
    type Hasher = FastHasher;
    fn build_hasher(&self) -> FastHasher {
        FastHasher(0)
    }
}

impl Hasher for FastHasher {
    fn finish(&self) -> u64 {
        // Hash tables index by the low bits and addresses are multiples of
        // 512, so fold the well-mixed high bits of the product down.
        let x = (self.0 ^ (self.0 >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^ (x >> 33)
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(buf));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = self.0.wrapping_add(v).wrapping_mul(SEED);
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn aligned_addresses_spread_over_low_bits() {
        let buckets: HashSet<u64> = (0..1024u64)
            .map(|i| {
                let mut h = FastState.build_hasher();
                h.write_u64(0x7f00_0000_0000 + i * 512);
                h.finish() & 1023
            })
            .collect();
        assert!(
            buckets.len() > 600,
            "only {} of 1024 buckets used",
            buckets.len()
        );
    }
}
