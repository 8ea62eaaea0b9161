//! Byte-level mutation in the style of libFuzzer's: bit flips, interesting integers at random
//! offsets (the counts and lengths a binary format trusts), block copies and deletions, dictionary
//! tokens (the words a parser branches on), and splices of two corpus entries.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Values that sit on the edges of integer checks, written little-endian.
const INTERESTING: [u64; 14] = [
    0,
    1,
    2,
    3,
    4,
    16,
    32,
    255,
    256,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    u64::MAX,
];

pub struct Mutator {
    rng: StdRng,
    /// Inputs never grow past this many bytes.
    max_len: usize,
}

impl Mutator {
    pub fn new(seed: u64, max_len: usize) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            max_len: max_len.max(1),
        }
    }

    pub fn rng(&mut self) -> &mut StdRng {
        &mut self.rng
    }

    /// A mutant of `base`: one to eight stacked edits, `other` used for splicing.
    pub fn mutate(&mut self, base: &[u8], other: &[u8], dict: &[&[u8]]) -> Vec<u8> {
        let mut data = base.to_vec();
        let edits = 1 << self.rng.gen_range(0..4);
        for _ in 0..edits {
            self.edit(&mut data, other, dict);
        }
        data.truncate(self.max_len);
        data
    }

    fn edit(&mut self, data: &mut Vec<u8>, other: &[u8], dict: &[&[u8]]) {
        match self.rng.gen_range(0..10) {
            0 => self.flip_bit(data),
            1 => self.set_byte(data),
            2 => self.interesting_int(data),
            3 => self.delete_block(data),
            4 => self.copy_block(data),
            5 | 6 if !dict.is_empty() => {
                let word = dict[self.rng.gen_range(0..dict.len())];
                self.insert(data, word);
            }
            7 if !other.is_empty() => self.splice(data, other),
            8 => {
                let n = self.rng.gen_range(1..=8);
                let bytes: Vec<u8> = (0..n).map(|_| self.rng.gen()).collect();
                self.insert(data, &bytes);
            }
            _ => self.arith(data),
        }
    }

    fn pos(&mut self, len: usize) -> usize {
        self.rng.gen_range(0..=len)
    }

    fn flip_bit(&mut self, data: &mut [u8]) {
        if !data.is_empty() {
            let i = self.rng.gen_range(0..data.len());
            data[i] ^= 1 << self.rng.gen_range(0..8);
        }
    }

    fn set_byte(&mut self, data: &mut [u8]) {
        if !data.is_empty() {
            let i = self.rng.gen_range(0..data.len());
            data[i] = self.rng.gen();
        }
    }

    /// Adds or subtracts a small amount from a byte, as a length off by a few would.
    fn arith(&mut self, data: &mut [u8]) {
        if !data.is_empty() {
            let i = self.rng.gen_range(0..data.len());
            data[i] = data[i].wrapping_add(
                self.rng
                    .gen_range(1..=16u8)
                    .wrapping_mul(if self.rng.gen() { 1 } else { u8::MAX }),
            );
        }
    }

    fn interesting_int(&mut self, data: &mut [u8]) {
        let width = [1usize, 2, 4, 8][self.rng.gen_range(0..4)];
        if data.len() < width {
            return;
        }
        let mut v = INTERESTING[self.rng.gen_range(0..INTERESTING.len())];
        if self.rng.gen_bool(0.25) {
            v = v.wrapping_add(self.rng.gen_range(0..4));
        }
        let at = self.rng.gen_range(0..=data.len() - width);
        data[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
    }

    fn delete_block(&mut self, data: &mut Vec<u8>) {
        if data.is_empty() {
            return;
        }
        let at = self.rng.gen_range(0..data.len());
        let n = self.block_len(data.len() - at);
        data.drain(at..at + n);
    }

    fn copy_block(&mut self, data: &mut Vec<u8>) {
        if data.is_empty() {
            return;
        }
        let from = self.rng.gen_range(0..data.len());
        let n = self.block_len(data.len() - from);
        let block = data[from..from + n].to_vec();
        self.insert(data, &block);
    }

    /// Mostly short blocks, sometimes long ones.
    fn block_len(&mut self, at_most: usize) -> usize {
        let cap = if self.rng.gen_bool(0.8) { 16 } else { 4096 };
        self.rng.gen_range(1..=at_most.clamp(1, cap))
    }

    fn insert(&mut self, data: &mut Vec<u8>, bytes: &[u8]) {
        if data.len() + bytes.len() > self.max_len {
            return;
        }
        let at = self.pos(data.len());
        data.splice(at..at, bytes.iter().copied());
    }

    /// The head of `data` joined to the tail of `other`.
    fn splice(&mut self, data: &mut Vec<u8>, other: &[u8]) {
        let cut = self.pos(data.len());
        let from = self.pos(other.len());
        data.truncate(cut);
        data.extend_from_slice(&other[from..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutants_differ_stay_bounded_and_are_reproducible() {
        let base = b"GGUF\x03\0\0\0 hello world".to_vec();
        let dict: &[&[u8]] = &[b"<|im_start|>"];
        let (mut a, mut b) = (Mutator::new(7, 64), Mutator::new(7, 64));
        let mut changed = 0;
        for _ in 0..1000 {
            let m = a.mutate(&base, b"other input", dict);
            assert!(m.len() <= 64);
            assert_eq!(m, b.mutate(&base, b"other input", dict));
            changed += usize::from(m != base);
        }
        assert!(changed > 900, "only {changed} of 1000 mutants differ");
    }
}
