//! Whole buffers converted between f32, bf16 and f16 in parallel blocks: autocast's casts of
//! weights, activations and gradients. Each value goes through f32 with
//! [`Element`]'s conversions (those of [`crate::convert`]). [`widen_into`] and [`store_sum`]
//! convert short runs in place for the other kernels (a product's operands and tiles, a
//! sum's), f16 with F16C where the CPU has it.

// The output is allocated without clearing (`fresh::written_by`); the unsafe block says why
// every element is written.
#![allow(unsafe_code)]

use std::any::TypeId;
use std::mem::MaybeUninit;

use half::bf16;
#[cfg(target_arch = "x86_64")]
use half::f16;
use rayon::prelude::*;

use crate::element::{DType, Element};
use crate::fresh::written_by;

/// `src` widened to f32 into `dst` (as long), exactly: f16 8 values an instruction with F16C
/// where the CPU has it (the products' packing of f16 operands read in runs).
#[inline]
pub fn widen_into<S: Element>(src: &[S], dst: &mut [f32]) {
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if let (DType::F16, Ok(src)) = (S::DTYPE, bytemuck::try_cast_slice::<S, f16>(src)) {
        done = crate::x86::widen_f16_lanes(src, dst);
    }
    for (d, s) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = s.to_f32();
    }
}

/// `values` (+ `plus`, element by element, when given) rounded once to `O` into `out` (as long
/// as `values`, every slot written): f16 by F16C 8 values an instruction where the CPU has it (a product's tile
/// with its bias, the sum of two activations).
#[inline]
pub fn store_sum<O: Element>(out: &mut [MaybeUninit<O>], values: &[f32], plus: Option<&[f32]>) {
    assert_eq!(
        out.len(),
        values.len(),
        "store_sum: {} slots for {} values",
        out.len(),
        values.len()
    );
    assert!(
        plus.is_none_or(|plus| plus.len() >= values.len()),
        "store_sum: fewer values to add than values"
    );
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if TypeId::of::<O>() == TypeId::of::<f16>() {
        // SAFETY: `O` is f16 (the same type id), so the cast only names the type.
        let out = unsafe { &mut *(std::ptr::from_mut(out) as *mut [MaybeUninit<f16>]) };
        done = crate::x86::store_f16_lanes(values, plus, out);
    }
    let (out, values) = (&mut out[done..], &values[done..]);
    match plus {
        Some(plus) => {
            for ((o, &v), &p) in out.iter_mut().zip(values).zip(&plus[done..]) {
                o.write(O::from_f32(v + p));
            }
        }
        None => {
            for (o, &v) in out.iter_mut().zip(values) {
                o.write(O::from_f32(v));
            }
        }
    }
}

/// Elements one task of [`cast`] converts: enough to pay for the task, few enough to spread a
/// layer's activations over every thread.
const CAST_BLOCK: usize = 1 << 15;

/// Values one step of [`cast_into`] widens into f32 on the stack before storing them.
const CAST_RUN: usize = 256;

/// `src` converted to `D` into `dst` (as long, every slot written) on the calling thread: f32
/// stored by [`store_sum`] directly, bf16 widened straight into f32 (a shift), anything else
/// in runs widened by [`widen_into`] and stored by [`store_sum`], so f16 takes F16C both ways
/// where the CPU has it. (A run through the stack costs a copy: in autocast's casts of bf16
/// and f32 that copy was 7 % of a bf16 step on AMX, measured.)
///
/// # Panics
/// When `dst` and `src` differ in length.
pub fn cast_into<S: Element, D: Element>(src: &[S], dst: &mut [MaybeUninit<D>]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "cast_into: {} values into {} slots",
        src.len(),
        dst.len()
    );
    let (from, to) = (TypeId::of::<S>(), TypeId::of::<D>());
    if from == TypeId::of::<f32>() {
        store_sum(dst, bytemuck::cast_slice::<S, f32>(src), None);
        return;
    }
    if from == TypeId::of::<bf16>() && to == TypeId::of::<f32>() {
        for (o, v) in dst.iter_mut().zip(src) {
            o.write(D::from_f32(v.to_f32()));
        }
        return;
    }
    let mut wide = [0.0f32; CAST_RUN];
    for (dst, src) in dst.chunks_mut(CAST_RUN).zip(src.chunks(CAST_RUN)) {
        let wide = &mut wide[..src.len()];
        widen_into(src, wide);
        store_sum(dst, wide, None);
    }
}

/// `src` converted to `D` (widening exact, narrowing rounded to nearest, ties to even), in
/// parallel blocks on the current rayon pool, each converted by [`cast_into`].
///
/// ```
/// use accelerate_kernels::cast::cast;
/// use half::bf16;
///
/// let narrow: Vec<bf16> = cast(&[1.0f32, 1.0 + 1.0 / 256.0, -3.5]);
/// assert_eq!(narrow, [bf16::from_f32(1.0), bf16::from_f32(1.0), bf16::from_f32(-3.5)]);
/// let wide: Vec<f32> = cast(&narrow);
/// assert_eq!(wide, [1.0, 1.0, -3.5]);
/// ```
pub fn cast<S: Element, D: Element>(src: &[S]) -> Vec<D> {
    let fill = |dst: &mut [MaybeUninit<D>]| {
        dst.par_chunks_mut(CAST_BLOCK)
            .zip(src.par_chunks(CAST_BLOCK))
            .for_each(|(dst, src)| cast_into(src, dst));
    };
    // SAFETY: `fill` receives `src.len()` values, cut in the same blocks as `src`, and
    // `cast_into` writes every value of its block.
    unsafe { written_by(src.len(), fill) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// The parallel cast gives, in every direction and across its block boundaries, the bits
    /// of `half`'s one-value conversions (through f32 for bf16 <-> f16).
    #[test]
    fn casts_equal_one_value_conversions() {
        let wide: Vec<f32> = crate::convert::narrowing_probes(1999)
            .take(3 * CAST_BLOCK + 17)
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let to_bf16: Vec<bf16> = cast(&wide);
        let to_f16: Vec<f16> = cast(&wide);
        let bf16_want: Vec<bf16> = wide.iter().map(|&x| bf16::from_f32(x)).collect();
        let f16_want: Vec<f16> = wide.iter().map(|&x| f16::from_f32(x)).collect();
        let same_half = |a: u16, b: u16, nan: bool| a == b || nan;
        for (i, x) in wide.iter().enumerate() {
            let nan = x.is_nan();
            assert!(
                same_half(to_bf16[i].to_bits(), bf16_want[i].to_bits(), nan),
                "bf16 of {x:e}"
            );
            assert!(
                same_half(to_f16[i].to_bits(), f16_want[i].to_bits(), nan),
                "f16 of {x:e}"
            );
        }
        let back: Vec<f32> = cast(&to_bf16);
        let want: Vec<f32> = to_bf16.iter().map(|x| x.to_f32()).collect();
        assert_eq!(bits(&back), bits(&want));
        let back: Vec<f32> = cast(&to_f16);
        let want: Vec<f32> = to_f16.iter().map(|x| x.to_f32()).collect();
        assert_eq!(bits(&back), bits(&want));
        let across: Vec<f16> = cast(&to_bf16);
        for (got, b) in across.iter().zip(&to_bf16) {
            let want = f16::from_f32(b.to_f32());
            assert!(
                same_half(got.to_bits(), want.to_bits(), b.is_nan()),
                "f16 of bf16 {b}"
            );
        }
        let same: Vec<f32> = cast(&wide);
        assert_eq!(bits(&same), bits(&wide));
    }

    /// The in-place widening (F16C for f16 where the CPU has it, in groups of 8 and a portable
    /// tail) gives the one-value conversions' bits for every f16 value, at lengths that end
    /// inside a group.
    #[test]
    fn widening_in_place_equals_one_value_conversions() {
        let every: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        for len in [every.len(), 13, 7] {
            let mut wide = vec![0.0f32; len];
            widen_into(&every[..len], &mut wide);
            for (w, h) in wide.iter().zip(&every) {
                let want = h.to_f32();
                assert!(
                    w.to_bits() == want.to_bits() || (w.is_nan() && want.is_nan()),
                    "{h:?}"
                );
            }
        }
    }
}
