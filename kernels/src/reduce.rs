//! Element-wise reductions of one buffer into another: the inner loop of every all-reduce.
//!
//! f32 buffers are combined directly in lanes the compiler vectorises. f16 and bf16 buffers are
//! widened to f32 a block at a time (with the branch-free conversions of [`crate::convert`]),
//! combined in f32 and rounded once, so the sum of two half-precision values is the correctly
//! rounded result in the output type.

use half::{bf16, f16};

pub use crate::element::{DType, Element, ReduceOp};
use crate::{LANES, convert};

/// Elements widened to f32 at a time in the half-precision loops (fits in L1 with its output).
const HALF_BLOCK: usize = 1024;

/// `acc[i] = op(acc[i], other[i])` for f32.
pub fn reduce_f32(acc: &mut [f32], other: &[f32], op: ReduceOp) {
    assert_eq!(acc.len(), other.len(), "reduce: length mismatch");
    // One monomorphic loop per operation, so each vectorises without a branch inside.
    match op {
        ReduceOp::Sum => zip_lanes(acc, other, |a, b| a + b),
        ReduceOp::Max => zip_lanes(acc, other, f32::max),
        ReduceOp::Min => zip_lanes(acc, other, f32::min),
    }
}

#[inline(always)]
fn zip_lanes(acc: &mut [f32], other: &[f32], f: impl Fn(f32, f32) -> f32 + Copy) {
    let mut a_chunks = acc.chunks_exact_mut(LANES);
    let mut b_chunks = other.chunks_exact(LANES);
    for (a, b) in (&mut a_chunks).zip(&mut b_chunks) {
        for (x, &y) in a.iter_mut().zip(b) {
            *x = f(*x, y);
        }
    }
    for (x, &y) in a_chunks
        .into_remainder()
        .iter_mut()
        .zip(b_chunks.remainder())
    {
        *x = f(*x, y);
    }
}

macro_rules! reduce_half {
    ($name:ident, $t:ty, $widen:path, $narrow:path) => {
        /// `acc[i] = op(acc[i], other[i])`, combined in f32 and rounded once (portable code).
        pub(crate) fn $name(acc: &mut [$t], other: &[$t], op: ReduceOp) {
            assert_eq!(acc.len(), other.len(), "reduce: length mismatch");
            let mut wide_a = [0.0_f32; HALF_BLOCK];
            let mut wide_b = [0.0_f32; HALF_BLOCK];
            for (a, b) in acc.chunks_mut(HALF_BLOCK).zip(other.chunks(HALF_BLOCK)) {
                let n = a.len();
                $widen(a, &mut wide_a[..n]);
                $widen(b, &mut wide_b[..n]);
                reduce_f32(&mut wide_a[..n], &wide_b[..n], op);
                $narrow(&wide_a[..n], a);
            }
        }
    };
}

reduce_half!(
    reduce_f16_portable,
    f16,
    convert::f16_to_f32_slice,
    convert::f32_to_f16_slice
);
reduce_half!(
    reduce_bf16_portable,
    bf16,
    convert::bf16_to_f32_slice,
    convert::f32_to_bf16_slice
);

/// `acc[i] = op(acc[i], other[i])` on f16 values, combined in f32 and rounded once (AVX2 and
/// F16C where the CPU has them).
pub fn reduce_f16(acc: &mut [f16], other: &[f16], op: ReduceOp) {
    assert_eq!(acc.len(), other.len(), "reduce: length mismatch");
    // The AVX2 build does the full groups of 8 where the CPU has it; the portable loop the rest.
    #[cfg(target_arch = "x86_64")]
    let done = crate::x86::reduce_f16_lanes(acc, other, op);
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    reduce_f16_portable(&mut acc[done..], &other[done..], op);
}

/// `acc[i] = op(acc[i], other[i])` on bf16 values, combined in f32 and rounded once (AVX2
/// where the CPU has it).
pub fn reduce_bf16(acc: &mut [bf16], other: &[bf16], op: ReduceOp) {
    assert_eq!(acc.len(), other.len(), "reduce: length mismatch");
    // The AVX2 build does the full groups of 8 where the CPU has it; the portable loop the rest.
    #[cfg(target_arch = "x86_64")]
    let done = crate::x86::reduce_bf16_lanes(acc, other, op);
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    reduce_bf16_portable(&mut acc[done..], &other[done..], op);
}

/// `acc[i] = op(acc[i], other[i])` for any [`Element`].
pub fn reduce<T: Element>(acc: &mut [T], other: &[T], op: ReduceOp) {
    reduce_bytes(
        T::DTYPE,
        op,
        bytemuck::cast_slice_mut(acc),
        bytemuck::cast_slice(other),
    );
}

/// The same on raw bytes of elements of `dtype` (as they arrive from a transport). Both slices
/// must hold whole elements; unaligned byte slices are handled by copying through a block.
pub fn reduce_bytes(dtype: DType, op: ReduceOp, acc: &mut [u8], other: &[u8]) {
    assert_eq!(acc.len(), other.len(), "reduce: length mismatch");
    assert_eq!(acc.len() % dtype.size(), 0, "reduce: partial element");
    match dtype {
        DType::F32 => with_aligned::<f32>(acc, other, |a, b| reduce_f32(a, b, op)),
        DType::F16 => with_aligned::<f16>(acc, other, |a, b| reduce_f16(a, b, op)),
        DType::BF16 => with_aligned::<bf16>(acc, other, |a, b| reduce_bf16(a, b, op)),
    }
}

/// Runs `f` on typed views of the byte slices, copying through aligned blocks when a slice is
/// not aligned for `T`.
fn with_aligned<T: Element>(acc: &mut [u8], other: &[u8], f: impl Fn(&mut [T], &[T])) {
    if let (Ok(a), Ok(b)) = (
        bytemuck::try_cast_slice_mut::<u8, T>(acc),
        bytemuck::try_cast_slice::<u8, T>(other),
    ) {
        return f(a, b);
    }
    const BLOCK: usize = 4096;
    let mut block_a = [T::zeroed(); BLOCK];
    let mut block_b = [T::zeroed(); BLOCK];
    let bytes = BLOCK * size_of::<T>();
    for (a, b) in acc.chunks_mut(bytes).zip(other.chunks(bytes)) {
        let n = a.len() / size_of::<T>();
        bytemuck::cast_slice_mut::<T, u8>(&mut block_a[..n]).copy_from_slice(a);
        bytemuck::cast_slice_mut::<T, u8>(&mut block_b[..n]).copy_from_slice(b);
        f(&mut block_a[..n], &block_b[..n]);
        a.copy_from_slice(bytemuck::cast_slice(&block_a[..n]));
    }
}

/// Multiplies elements of `dtype` in `bytes` by `factor` (f32 arithmetic, rounded once).
pub fn scale_bytes(dtype: DType, bytes: &mut [u8], factor: f32) {
    match dtype {
        DType::F32 => with_aligned_one::<f32>(bytes, |v| crate::scale_in_place(v, factor)),
        DType::F16 => with_aligned_one::<f16>(bytes, |v| scale_f16(v, factor)),
        DType::BF16 => with_aligned_one::<bf16>(bytes, |v| scale_bf16(v, factor)),
    }
}

macro_rules! scale_half {
    ($name:ident, $t:ty, $widen:path, $narrow:path) => {
        /// Multiplies every element by `factor` in f32, rounding once (portable code).
        pub(crate) fn $name(values: &mut [$t], factor: f32) {
            let mut wide = [0.0_f32; HALF_BLOCK];
            for block in values.chunks_mut(HALF_BLOCK) {
                let n = block.len();
                $widen(block, &mut wide[..n]);
                crate::scale_in_place(&mut wide[..n], factor);
                $narrow(&wide[..n], block);
            }
        }
    };
}

scale_half!(
    scale_f16_portable,
    f16,
    convert::f16_to_f32_slice,
    convert::f32_to_f16_slice
);
scale_half!(
    scale_bf16_portable,
    bf16,
    convert::bf16_to_f32_slice,
    convert::f32_to_bf16_slice
);

/// Multiplies f16 values by `factor` in f32, rounding once.
pub fn scale_f16(values: &mut [f16], factor: f32) {
    // The AVX2 build does the full groups of 8 where the CPU has it; the portable loop the rest.
    #[cfg(target_arch = "x86_64")]
    let done = crate::x86::scale_f16_lanes(values, factor);
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    scale_f16_portable(&mut values[done..], factor);
}

/// Multiplies bf16 values by `factor` in f32, rounding once.
pub fn scale_bf16(values: &mut [bf16], factor: f32) {
    // The AVX2 build does the full groups of 8 where the CPU has it; the portable loop the rest.
    #[cfg(target_arch = "x86_64")]
    let done = crate::x86::scale_bf16_lanes(values, factor);
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    scale_bf16_portable(&mut values[done..], factor);
}

fn with_aligned_one<T: Element>(bytes: &mut [u8], f: impl Fn(&mut [T])) {
    if let Ok(v) = bytemuck::try_cast_slice_mut::<u8, T>(bytes) {
        return f(v);
    }
    let mut block = vec![T::zeroed(); bytes.len() / size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut block).copy_from_slice(bytes);
    f(&mut block);
    bytes.copy_from_slice(bytemuck::cast_slice(&block));
}

/// `op` applied to two f32 values; exposed for reference implementations in tests.
pub fn apply(op: ReduceOp, a: f32, b: f32) -> f32 {
    op.apply(a, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];
    const LENS: [usize; 8] = [0, 1, 15, 16, 17, 1023, 1025, 4099];

    fn values(len: usize, salt: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7 + salt * 13) % 101) as f32 - 50.0) / 8.0)
            .collect()
    }

    #[test]
    fn f32_matches_the_scalar_reference() {
        for op in OPS {
            for len in LENS {
                let (a, b) = (values(len, 1), values(len, 2));
                let mut got = a.clone();
                reduce_f32(&mut got, &b, op);
                let want: Vec<f32> = a.iter().zip(&b).map(|(&x, &y)| apply(op, x, y)).collect();
                assert_eq!(got, want, "{op:?} len {len}");
            }
        }
    }

    #[test]
    fn half_precision_is_combined_in_f32_and_rounded_once() {
        for op in OPS {
            for len in LENS {
                let (a, b) = (values(len, 3), values(len, 4));
                let a16: Vec<f16> = a.iter().map(|&x| f16::from_f32(x)).collect();
                let b16: Vec<f16> = b.iter().map(|&x| f16::from_f32(x * 1.001)).collect();
                let mut got = a16.clone();
                reduce(&mut got, &b16, op);
                for i in 0..len {
                    let want = f16::from_f32(apply(op, a16[i].to_f32(), b16[i].to_f32()));
                    assert_eq!(got[i], want, "f16 {op:?} len {len} at {i}");
                }
                let ab: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
                let bb: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x * 1.001)).collect();
                let mut got = ab.clone();
                reduce(&mut got, &bb, op);
                for i in 0..len {
                    let want = bf16::from_f32(apply(op, ab[i].to_f32(), bb[i].to_f32()));
                    assert_eq!(got[i], want, "bf16 {op:?} len {len} at {i}");
                }
            }
        }
    }

    #[test]
    fn unaligned_bytes_reduce_like_aligned_ones() {
        let (a, b) = (values(1000, 5), values(1000, 6));
        let mut want = a.clone();
        reduce_f32(&mut want, &b, ReduceOp::Sum);
        // Shift both buffers by one byte so neither is 4-byte aligned.
        let mut acc = vec![0u8; 4001];
        let mut other = vec![0u8; 4001];
        acc[1..].copy_from_slice(bytemuck::cast_slice(&a));
        other[1..].copy_from_slice(bytemuck::cast_slice(&b));
        reduce_bytes(DType::F32, ReduceOp::Sum, &mut acc[1..], &other[1..]);
        assert_eq!(&acc[1..], bytemuck::cast_slice::<f32, u8>(&want));
    }

    #[test]
    fn scaling_rounds_once_per_element() {
        let v: Vec<f32> = values(3000, 7);
        let mut h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        let orig = h.clone();
        scale_bytes(DType::F16, bytemuck::cast_slice_mut(&mut h), 0.5);
        for (got, x) in h.iter().zip(&orig) {
            assert_eq!(*got, f16::from_f32(x.to_f32() * 0.5));
        }
        let mut f = v.clone();
        scale_bytes(DType::F32, bytemuck::cast_slice_mut(&mut f), 0.25);
        assert!(f.iter().zip(&v).all(|(a, b)| *a == b * 0.25));
    }

    #[test]
    fn dispatched_loops_equal_the_portable_ones_bit_for_bit() {
        // Specials included: NaN, infinities, subnormals, values that overflow when combined.
        let specials = [
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            65504.0,
            -65504.0,
            6e-8,
            -3e-5,
            0.0,
            -0.0,
            1e30,
        ];
        for op in OPS {
            for len in LENS {
                let a: Vec<f32> = values(len, 8)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        if i % 13 == 5 {
                            specials[i % specials.len()]
                        } else {
                            v * 1000.3
                        }
                    })
                    .collect();
                let b: Vec<f32> = values(len, 9)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        if i % 11 == 3 {
                            specials[(i + 4) % specials.len()]
                        } else {
                            v * 0.37
                        }
                    })
                    .collect();
                let (a16, b16): (Vec<f16>, Vec<f16>) = (
                    a.iter().map(|&x| f16::from_f32(x)).collect(),
                    b.iter().map(|&x| f16::from_f32(x)).collect(),
                );
                let (mut x, mut y) = (a16.clone(), a16.clone());
                reduce_f16(&mut x, &b16, op);
                reduce_f16_portable(&mut y, &b16, op);
                same(
                    &bits(&x),
                    &bits(&y),
                    0x7c00,
                    &format!("f16 {op:?} len {len}"),
                );
                let (ab, bb): (Vec<bf16>, Vec<bf16>) = (
                    a.iter().map(|&x| bf16::from_f32(x)).collect(),
                    b.iter().map(|&x| bf16::from_f32(x)).collect(),
                );
                let (mut x, mut y) = (ab.clone(), ab.clone());
                reduce_bf16(&mut x, &bb, op);
                reduce_bf16_portable(&mut y, &bb, op);
                same(
                    &bits(&x),
                    &bits(&y),
                    0x7f80,
                    &format!("bf16 {op:?} len {len}"),
                );
                let (mut x, mut y) = (a16.clone(), a16.clone());
                scale_f16(&mut x, 0.3);
                scale_f16_portable(&mut y, 0.3);
                same(
                    &bits(&x),
                    &bits(&y),
                    0x7c00,
                    &format!("scale f16 len {len}"),
                );
                let (mut x, mut y) = (ab.clone(), ab.clone());
                scale_bf16(&mut x, 0.3);
                scale_bf16_portable(&mut y, 0.3);
                same(
                    &bits(&x),
                    &bits(&y),
                    0x7f80,
                    &format!("scale bf16 len {len}"),
                );
            }
        }
    }

    /// Equal bits, except that any two NaNs match and +0 matches -0 (max/min of two zeros
    /// may return either, in hardware and in `f32::max` alike).
    fn same(a: &[u16], b: &[u16], exponent_mask: u16, what: &str) {
        for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
            let nan =
                |v: u16| v & exponent_mask == exponent_mask && v & !exponent_mask & 0x7fff != 0;
            let zero = |v: u16| v & 0x7fff == 0;
            assert!(
                x == y || (nan(x) && nan(y)) || (zero(x) && zero(y)),
                "{what}: element {i} differs: {x:#06x} vs {y:#06x}"
            );
        }
    }

    fn bits<T: bytemuck::Pod>(v: &[T]) -> Vec<u16> {
        bytemuck::cast_slice::<T, u16>(v).to_vec()
    }

    #[test]
    fn dtype_codes_round_trip() {
        for d in [DType::F32, DType::F16, DType::BF16] {
            assert_eq!(DType::from_code(d as u8), Some(d));
        }
        assert_eq!(DType::from_code(9), None);
    }
}
