//! Element-wise sums of two buffers of any [`Element`] type, each value computed in f32 and
//! rounded once, in parallel blocks: the residual connections of a transformer under autocast
//! (Flex adds bf16 and f16 one value at a time on the calling thread, each f16 through two
//! conversion calls: most of what the second core waited for in an fp16 step).

// The output is allocated without clearing (`fresh::written_by`); the unsafe block says why
// every element is written.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::cast::{store_sum, widen_into};
use crate::element::Element;
use crate::fresh::written_by;

/// Values one task adds: enough to pay for the task, few enough to use every thread.
const ADD_BLOCK: usize = 1 << 14;
/// Values widened at a time (on the stack).
const RUN: usize = 256;

/// `a[i] + b[i]` for every `i`, in f32, rounded once to `T` (for f32, the plain sum): the bits
/// of `T::from_f32(a.to_f32() + b.to_f32())`, as Burn's backends add half-precision values.
///
/// ```
/// use accelerate_kernels::add::add;
/// use half::f16;
///
/// let a = [1.0f32, 2.5, -3.0].map(f16::from_f32);
/// let b = [0.5f32, 0.25, 3.0].map(f16::from_f32);
/// assert_eq!(add(&a, &b), [1.5f32, 2.75, 0.0].map(f16::from_f32));
/// ```
///
/// # Panics
/// When `a` and `b` differ in length.
pub fn add<T: Element>(a: &[T], b: &[T]) -> Vec<T> {
    assert_eq!(a.len(), b.len(), "add: {} values and {}", a.len(), b.len());
    let fill = |out: &mut [MaybeUninit<T>]| {
        out.par_chunks_mut(ADD_BLOCK)
            .zip(a.par_chunks(ADD_BLOCK).zip(b.par_chunks(ADD_BLOCK)))
            .for_each(|(out, (a, b))| {
                let (mut wide_a, mut wide_b) = ([0.0f32; RUN], [0.0f32; RUN]);
                for (out, (a, b)) in out.chunks_mut(RUN).zip(a.chunks(RUN).zip(b.chunks(RUN))) {
                    let (wide_a, wide_b) = (&mut wide_a[..a.len()], &mut wide_b[..b.len()]);
                    widen_into(a, wide_a);
                    widen_into(b, wide_b);
                    store_sum(out, wide_a, Some(wide_b));
                }
            });
    };
    // SAFETY: `out`, `a` and `b` are cut in the same blocks and runs (equal lengths,
    // asserted), and `store_sum` writes every slot of its run.
    unsafe { written_by(a.len(), fill) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// Across block and run edges, f16, bf16 and f32 sums are the bits of one rounding of the
    /// f32 sum, as Burn's backends compute them.
    #[test]
    fn sums_are_the_f32_sum_rounded_once() {
        let n = 2 * ADD_BLOCK + RUN + 13;
        let wide = |seed: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 20_011) as f32 / 97.0 - 100.0)
                .collect()
        };
        let (x, y) = (wide(1), wide(7));
        let halves = |v: &[f32]| -> (Vec<f16>, Vec<bf16>) {
            (
                v.iter().map(|&x| f16::from_f32(x)).collect(),
                v.iter().map(|&x| bf16::from_f32(x)).collect(),
            )
        };
        let ((xh, xb), (yh, yb)) = (halves(&x), halves(&y));
        let got = add(&xh, &yh);
        for i in 0..n {
            let want = f16::from_f32(xh[i].to_f32() + yh[i].to_f32());
            assert_eq!(got[i].to_bits(), want.to_bits(), "f16 {i}");
        }
        let got = add(&xb, &yb);
        for i in 0..n {
            let want = bf16::from_f32(xb[i].to_f32() + yb[i].to_f32());
            assert_eq!(got[i].to_bits(), want.to_bits(), "bf16 {i}");
        }
        let got = add(&x, &y);
        for i in 0..n {
            assert_eq!(got[i].to_bits(), (x[i] + y[i]).to_bits(), "f32 {i}");
        }
    }
}
