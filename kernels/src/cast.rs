//! Whole buffers converted between f32, bf16 and f16 in parallel blocks: autocast's casts of
//! weights, activations and gradients. Each value goes through f32 with
//! [`Element`]'s conversions (those of [`crate::convert`]).

// The output is allocated without clearing (`fresh::written_by`); the unsafe block says why
// every element is written.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::element::Element;
use crate::fresh::written_by;

/// Elements one task of [`cast`] converts: enough to pay for the task, few enough to spread a
/// layer's activations over every thread.
const CAST_BLOCK: usize = 1 << 15;

/// `src` converted to `D` (widening exact, narrowing rounded to nearest, ties to even), in
/// parallel blocks on the current rayon pool.
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
            .for_each(|(dst, src)| {
                for (d, &s) in dst.iter_mut().zip(src) {
                    d.write(D::from_f32(s.to_f32()));
                }
            });
    };
    // SAFETY: `fill` receives `src.len()` values, cut in the same blocks as `src`, so each
    // block's zip writes every value of its block.
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
}
