//! The order in which an epoch visits a data set: a pure function of `(seed, epoch)`.
//!
//! The permutation is drawn with our own SplitMix64 generator and a Fisher-Yates shuffle, so it
//! is the same on every process, every platform and every version of every dependency. That
//! makes it part of the resume contract: a test freezes its output, and changing it breaks
//! exact resume of existing checkpoints.

use serde::{Deserialize, Serialize};

/// SplitMix64 (Steele, Lea and Flood, 2014): a tiny, fast, well-mixed 64-bit generator.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform integer in `0..bound` (`bound > 0`), without modulo bias (Lemire's method).
    pub fn below(&mut self, bound: u64) -> u64 {
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let product = u128::from(self.next_u64()) * u128::from(bound);
            if (product as u64) >= threshold {
                return (product >> 64) as u64;
            }
        }
    }
}

/// The generator for `epoch` of a run seeded with `seed`: epochs draw independent streams.
pub fn epoch_rng(seed: u64, epoch: u64) -> SplitMix64 {
    let mut mix = SplitMix64::new(seed ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03));
    SplitMix64::new(mix.next_u64())
}

/// The indices `0..len` in the order epoch `epoch` visits them: shuffled with `(seed, epoch)`,
/// or in order when `shuffle` is false.
pub fn epoch_order(len: usize, shuffle: bool, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    if shuffle {
        let mut rng = epoch_rng(seed, epoch);
        for i in (1..len).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
    }
    order
}

/// How a shuffled epoch order is made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShuffleOrder {
    /// A Fisher-Yates shuffle of the whole epoch ([`epoch_order`]), held while the epoch
    /// runs: 8 bytes per item.
    #[default]
    Drawn,
    /// A keyed bijection of `0..len` ([`KeyedOrder`]), computed at each position: memory
    /// independent of the number of items, for data sets larger than memory.
    Keyed,
}

/// Rounds of [`KeyedOrder`]'s Feistel network.
const ROUNDS: usize = 6;

/// A shuffled order of `0..len` computed position by position, in constant memory: a Feistel
/// network keyed by `(seed, epoch)` permutes the numbers of the smallest even number of bits
/// that holds `len`, and a value outside `0..len` is permuted again until it falls inside
/// (cycle walking: fewer than four rounds of the network on average), which keeps it a
/// bijection of `0..len`. Frozen like [`epoch_order`]: part of the resume contract.
#[derive(Debug, Clone)]
pub struct KeyedOrder {
    len: u64,
    half_bits: u32,
    keys: [u64; ROUNDS],
}

impl KeyedOrder {
    /// The order of epoch `epoch` of `len` items, seeded with `seed`.
    pub fn new(len: usize, seed: u64, epoch: u64) -> Self {
        let len = len as u64;
        let bits = (u64::BITS - len.saturating_sub(1).leading_zeros()).max(2);
        let mut rng = epoch_rng(seed ^ 0x2545_F491_4F6C_DD1D, epoch);
        Self {
            len,
            half_bits: bits.div_ceil(2),
            keys: std::array::from_fn(|_| rng.next_u64()),
        }
    }

    /// The item at `position` (below `len`; past it, `position` itself).
    pub fn at(&self, position: usize) -> usize {
        let mut x = position as u64;
        if x >= self.len {
            return position;
        }
        loop {
            x = self.permute(x);
            if x < self.len {
                return x as usize;
            }
        }
    }

    /// One pass of the network over `2 * half_bits` bits.
    fn permute(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut left, mut right) = (x >> self.half_bits, x & mask);
        for key in self.keys {
            let mut z = (right ^ key).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (left, right) = (right, left ^ ((z ^ (z >> 31)) & mask));
        }
        (left << self.half_bits) | right
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_frozen() {
        // Part of the resume contract: changing these numbers breaks existing checkpoints.
        assert_eq!(epoch_order(10, true, 42, 0), [1, 7, 2, 5, 6, 4, 0, 9, 8, 3]);
        assert_eq!(epoch_order(10, true, 42, 1), [8, 9, 4, 3, 7, 1, 5, 6, 0, 2]);
        assert_eq!(SplitMix64::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn order_is_a_permutation_that_depends_on_seed_and_epoch() {
        for len in [0, 1, 2, 17, 1000] {
            let mut o = epoch_order(len, true, 7, 3);
            o.sort_unstable();
            assert_eq!(o, (0..len).collect::<Vec<_>>());
        }
        assert_ne!(epoch_order(100, true, 7, 0), epoch_order(100, true, 7, 1));
        assert_ne!(epoch_order(100, true, 7, 0), epoch_order(100, true, 8, 0));
        assert_eq!(epoch_order(100, true, 7, 5), epoch_order(100, true, 7, 5));
        assert_eq!(epoch_order(5, false, 7, 5), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn below_is_uniform_enough() {
        let mut rng = SplitMix64::new(1);
        let mut counts = [0u32; 6];
        for _ in 0..60_000 {
            counts[rng.below(6) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (9_000..11_000).contains(&c)),
            "{counts:?}"
        );
    }

    #[test]
    fn the_keyed_order_is_a_frozen_permutation() {
        // Part of the resume contract: changing these numbers breaks existing checkpoints.
        let order = |len, epoch| {
            let keyed = KeyedOrder::new(len, 42, epoch);
            (0..len).map(|p| keyed.at(p)).collect::<Vec<_>>()
        };
        assert_eq!(order(10, 0), [7, 8, 0, 5, 2, 3, 1, 4, 6, 9]);
        assert_eq!(order(10, 1), [5, 6, 2, 1, 9, 3, 8, 4, 7, 0]);
        for len in [0, 1, 2, 3, 5, 17, 64, 1000, 4097] {
            let mut o = order(len, 3);
            o.sort_unstable();
            assert_eq!(o, (0..len).collect::<Vec<_>>());
        }
        assert_ne!(order(100, 0), order(100, 1));
        assert_eq!(KeyedOrder::new(5, 1, 1).at(7), 7);
    }

    #[test]
    fn the_keyed_order_places_items_uniformly() {
        // Over 30,000 epochs of 12 items, each item comes first and last about as often.
        let (mut first, mut last) = ([0u32; 12], [0u32; 12]);
        for epoch in 0..30_000 {
            let keyed = KeyedOrder::new(12, 7, epoch);
            first[keyed.at(0)] += 1;
            last[keyed.at(11)] += 1;
        }
        for counts in [first, last] {
            assert!(
                counts.iter().all(|&c| (2_250..2_750).contains(&c)),
                "{counts:?}"
            );
        }
    }
}
