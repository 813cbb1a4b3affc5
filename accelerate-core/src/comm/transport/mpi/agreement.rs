//! The call agreement of the MPI engine. MPI matches collectives by their order alone: a rank
//! that calls all_reduce while a peer calls broadcast, or reduces another length, gets garbage,
//! an error from deep inside MPI, or a hang. So every call carries a check: [`CHECK_FLOATS`]
//! f32 values encoding a digest of the call, which MPI reduces with MPI's own operation,
//! appended to the payload of a small f32 all-reduce (one MPI call, no user-defined operation,
//! which costs Open MPI several microseconds) or alone just before every other call.
//!
//! The digest is cut into chunks of `b` bits; each chunk `c` becomes `v = c + 1` in `1..=2^b`
//! and travels as a pair: `(v, v^2)` under a sum, `(v, 2^b + 1 - v)` under a max or a min.
//! Afterwards every rank made the same call exactly when, for every pair, `n * sum(v^2) ==
//! sum(v)^2` (equality in Cauchy-Schwarz: all `v` equal), or when the max and the reflected max
//! add up to `2^b + 1` (the largest `v` is also the smallest). Sums of small integers are exact
//! in f32 whatever the order, so every rank reaches the same verdict; `b` shrinks for large
//! worlds so that they stay exact. A mismatch is then described by one all-gather of every
//! rank's call, which all ranks make since all saw it.
//!
//! Messages are rounded up to [`GRAIN_FLOATS`] floats, so calls that differ by a few elements
//! are the same size to MPI and meet in one reduction.
//!
//! This in-band check is for jobs spanning hosts. When every rank is on this host, the
//! progress board ([`super::board`]) carries each call instead, at no cost in MPI: appending
//! 64 bytes to a 4 KiB all-reduce would cross Open MPI's 4 KiB eager limit and slow it by a
//! microsecond.

use accelerate_kernels::ReduceOp;

use crate::comm::call::CallDesc;
use crate::error::CommError;

/// Floats of the check: 8 pairs.
pub const CHECK_FLOATS: usize = 16;
const PAIRS: usize = CHECK_FLOATS / 2;
/// Messages are rounded up to a multiple of this many floats.
pub const GRAIN_FLOATS: usize = 64;

/// Floats MPI reduces for an all-reduce of `payload` floats with the check appended.
pub fn message_floats(payload: usize) -> usize {
    (payload + CHECK_FLOATS).div_ceil(GRAIN_FLOATS) * GRAIN_FLOATS
}

/// Bits per chunk for `world` ranks: `world * 4^b` stays below 2^24, where f32 sums of
/// integers are exact.
fn chunk_bits(world: usize) -> u32 {
    let log2 = usize::BITS - world.max(1).leading_zeros(); // ceil-ish, errs small
    (24u32.saturating_sub(log2) / 2).clamp(1, 6)
}

/// A 64-bit digest of a packed call.
fn digest(call: &CallDesc) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in call.pack() {
        h = (h ^ w).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29);
    }
    h
}

/// This rank's check for `call` in a job of `world` ranks, for a reduction by `op`.
pub fn encode(call: &CallDesc, world: usize, op: ReduceOp) -> [f32; CHECK_FLOATS] {
    let bits = chunk_bits(world);
    let top = (1u64 << bits) + 1;
    let h = digest(call);
    let mut check = [0.0; CHECK_FLOATS];
    for pair in 0..PAIRS {
        let v = (h >> (pair as u32 * bits)) & ((1 << bits) - 1);
        let v = v + 1;
        let second = match op {
            ReduceOp::Sum => v * v,
            ReduceOp::Max | ReduceOp::Min => top - v,
        };
        check[2 * pair] = v as f32;
        check[2 * pair + 1] = second as f32;
    }
    check
}

/// Whether the reduced check says every rank made the same call.
pub fn agreed(check: &[f32], world: usize, op: ReduceOp) -> bool {
    let top = ((1u64 << chunk_bits(world)) + 1) as f64;
    check.len() == CHECK_FLOATS
        && check.chunks_exact(2).all(|pair| {
            let (a, b) = (f64::from(pair[0]), f64::from(pair[1]));
            match op {
                ReduceOp::Sum => world as f64 * b == a * a,
                ReduceOp::Max | ReduceOp::Min => a + b == top,
            }
        })
}

/// The mismatch seen by `rank`, from every rank's packed call (rank order, 4 little-endian
/// u64 each): the first rank whose call differs from this one's.
pub fn mismatch(calls: &[u8], call: &CallDesc, rank: usize) -> CommError {
    let mine = call.pack();
    let other = calls
        .chunks_exact(32)
        .enumerate()
        .find_map(|(peer, bytes)| {
            let words: [u64; 4] = std::array::from_fn(|i| {
                let mut w = [0u8; 8];
                w.copy_from_slice(&bytes[8 * i..8 * i + 8]);
                u64::from_le_bytes(w)
            });
            (words != mine).then_some((peer, words))
        });
    match other {
        Some((peer, words)) => named_mismatch(rank, call, peer, words),
        // Every rank reports the same call: their reductions disagreed (another operation).
        None => CommError::Mismatch {
            rank,
            ours: format!("called {call}"),
            peer: rank,
            theirs: "reduced it with another operation or element type on some rank".into(),
        },
    }
}

/// The mismatch between this rank's `call` and `peer`'s call, packed as `theirs`.
pub fn named_mismatch(rank: usize, call: &CallDesc, peer: usize, theirs: [u64; 4]) -> CommError {
    CommError::Mismatch {
        rank,
        ours: format!("called {call}"),
        peer,
        theirs: match CallDesc::unpack(theirs) {
            Some(theirs) => format!("called {theirs}"),
            None => "made another call".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::call::OpKind;
    use accelerate_kernels::DType;

    fn all_reduce(seq: u64, count: u64, op: ReduceOp) -> CallDesc {
        let mut call = CallDesc::new(OpKind::AllReduce, seq);
        call.count = count;
        call.dtype = Some(DType::F32);
        call.reduce = Some(op);
        call
    }

    /// What MPI's reduction of the ranks' checks gives.
    fn reduce(checks: &[[f32; CHECK_FLOATS]], op: ReduceOp) -> Vec<f32> {
        (0..CHECK_FLOATS)
            .map(|i| {
                let values = checks.iter().map(|c| c[i]);
                match op {
                    ReduceOp::Sum => values.sum(),
                    ReduceOp::Max => values.fold(f32::MIN, f32::max),
                    ReduceOp::Min => values.fold(f32::MAX, f32::min),
                }
            })
            .collect()
    }

    #[test]
    fn equal_calls_agree_and_any_difference_is_seen_under_every_operation() {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            for world in [2usize, 3, 4, 64, 5000, 1 << 20] {
                let call = all_reduce(9, 1000, op);
                let same = vec![encode(&call, world, op); world.min(64)];
                // Only `world.min(64)` checks are summed here; pad the sum to `world` ranks.
                let mut reduced = reduce(&same, op);
                if op == ReduceOp::Sum {
                    let scale = world as f32 / same.len() as f32;
                    reduced.iter_mut().for_each(|v| *v *= scale);
                }
                assert!(agreed(&reduced, world, op), "{op:?} world {world}");
                for other in [all_reduce(9, 1001, op), all_reduce(10, 1000, op)] {
                    let mut checks = same.clone();
                    checks[1] = encode(&other, world, op);
                    let mut reduced = reduce(&checks, op);
                    if op == ReduceOp::Sum {
                        let scale = world as f32 / checks.len() as f32;
                        reduced.iter_mut().for_each(|v| *v *= scale);
                    }
                    if world <= 64 {
                        assert!(!agreed(&reduced, world, op), "{op:?} world {world}");
                    }
                }
            }
        }
    }

    #[test]
    fn sums_of_checks_stay_exact_in_f32() {
        for world in [2usize, 4096, 1 << 20] {
            let bits = chunk_bits(world);
            let largest = (1u64 << bits) * (1u64 << bits) * world as u64;
            assert!(largest <= 1 << 24, "world {world}: {largest}");
        }
        assert_eq!(message_floats(0), GRAIN_FLOATS);
        assert_eq!(message_floats(48), GRAIN_FLOATS);
        assert_eq!(message_floats(49), 2 * GRAIN_FLOATS);
    }

    #[test]
    fn a_mismatch_names_the_first_other_rank_and_its_call() {
        let ours = all_reduce(3, 10, ReduceOp::Sum);
        let mut broadcast = CallDesc::new(OpKind::Broadcast, 3);
        broadcast.count = 10;
        broadcast.root = Some(0);
        let calls: Vec<u8> = [ours, ours, broadcast]
            .iter()
            .flat_map(|c| c.pack().map(u64::to_le_bytes).concat())
            .collect();
        let CommError::Mismatch { peer, theirs, .. } = mismatch(&calls, &ours, 0) else {
            panic!("not a mismatch");
        };
        assert_eq!((peer, theirs), (2, format!("called {broadcast}")));
        let CommError::Mismatch { peer, theirs, .. } = mismatch(&calls, &broadcast, 2) else {
            panic!("not a mismatch");
        };
        assert_eq!((peer, theirs), (0, format!("called {ours}")));
    }

    fn op_of(code: u8) -> ReduceOp {
        [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min][usize::from(code % 3)]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Up to 8 ranks, each making one of two random calls: the reduced checks agree exactly
        /// when the ranks' checks are equal (the encoding loses nothing to f32 rounding), and
        /// the all-gather that follows names a rank whose call differs.
        #[test]
        fn the_agreement_sees_exactly_the_ranks_that_differ(
            words in proptest::array::uniform2(proptest::array::uniform4(
                proptest::prelude::any::<u64>())),
            assignment in proptest::collection::vec(proptest::prelude::any::<bool>(), 1..8),
            code in 0u8..3,
        ) {
            let op = op_of(code);
            // Words no call packs to stand for a call of another build: any u64s.
            let calls = words.map(|w| CallDesc::unpack(w).unwrap_or(all_reduce(w[1], w[2], op)));
            let world = assignment.len();
            let mine: Vec<CallDesc> = assignment.iter().map(|&b| calls[usize::from(b)]).collect();
            let checks: Vec<[f32; CHECK_FLOATS]> = mine.iter().map(|c| encode(c, world, op)).collect();
            let same = checks.iter().all(|c| c == &checks[0]);
            proptest::prop_assert_eq!(agreed(&reduce(&checks, op), world, op), same);
            let packed: Vec<u8> = mine.iter().flat_map(|c| c.pack().map(u64::to_le_bytes).concat()).collect();
            for (rank, call) in mine.iter().enumerate() {
                if let CommError::Mismatch { peer, .. } = mismatch(&packed, call, rank) {
                    proptest::prop_assert!(peer < world);
                    if peer != rank {
                        proptest::prop_assert!(mine[peer] != *call);
                    }
                }
            }
        }

        /// Whatever MPI hands back (any floats, any bytes, any length): a verdict or an error
        /// naming a rank, never a panic; packed calls decode only to what packs back to them.
        #[test]
        fn the_agreement_decoders_never_panic(
            check in proptest::collection::vec(proptest::prelude::any::<f32>(), 0..20),
            calls in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
            world in proptest::prelude::any::<usize>(),
            rank in 0usize..8,
            code in 0u8..3,
            words in proptest::array::uniform4(proptest::prelude::any::<u64>()),
        ) {
            let op = op_of(code);
            let _ = agreed(&check, world, op);
            let ours = all_reduce(1, 2, op);
            if let CommError::Mismatch { peer, .. } = mismatch(&calls, &ours, rank) {
                proptest::prop_assert!(peer == rank || peer < calls.len() / 32);
            }
            if let Some(call) = CallDesc::unpack(words) {
                proptest::prop_assert_eq!(call.pack(), words);
            }
        }
    }
}
