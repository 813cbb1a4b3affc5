//! The exact GELU, `x * Φ(x)` (Φ the standard normal distribution function), and its
//! derivative, over flat buffers in parallel with a vectorised `erfc`.
//!
//! Burn's Flex backend computes GELU with a scalar `erf` call per element on one core below
//! its parallel threshold; a transformer's MLP activations (`tokens * 4 * d_model` values per
//! layer) are a few million. Here the rational `erfc` of Numerical Recipes (fractional error
//! below 1.2e-7 for every argument) runs on [`crate::rows`]' vectorisable `exp`, so the result
//! is accurate relative to its value, in the negative tail too where `1 + erf` cancels. Its
//! multiply-adds are fused (`mul_add`), so on a CPU with AVX-512 or AVX2 and FMA the same loop,
//! compiled for it, computes the same bits as the portable one, 16 or 8 lanes at a time.
//!
//!
//! [`forward_half`] and [`backward_half`] take bf16 or f16 values (autocast's activations) and
//! compute each chunk in f32.
//!
//! ```
//! use accelerate_kernels::gelu::{backward, forward};
//!
//! let x = [-1.0_f32, 0.0, 2.0];
//! let y = forward(&x);
//! assert!((y[0] + 0.158_655_25).abs() < 1e-6 && y[1] == 0.0 && (y[2] - 1.954_499_7).abs() < 1e-6);
//! let dx = backward(&x, &[1.0; 3]);
//! assert!((dx[1] - 0.5).abs() < 1e-7); // Φ(0)
//! ```

// The outputs are allocated without clearing (`fresh::written_by`); each unsafe block says why
// every element is written.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::element::Element;
use crate::fresh::written_by;

pub(crate) mod chunk;

use chunk::{backward_chunk, forward_chunk, recompute_backward_chunk};

/// Elements per parallel task.
const CHUNK: usize = 16 * 1024;

/// `y = x * Φ(x)` for every element, as a new vector.
pub fn forward(x: &[f32]) -> Vec<f32> {
    let fill = |y: &mut [MaybeUninit<f32>]| {
        y.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(y, x)| {
                #[cfg(target_arch = "x86_64")]
                if crate::x86::try_gelu_forward(x, y) {
                    return;
                }
                forward_chunk(x, y);
            });
    };
    // SAFETY: the chunks of `y` and `x` pair up one to one with equal lengths, and each loop
    // writes every element of its chunk of `y`.
    unsafe { written_by(x.len(), fill) }
}

/// `dx = dy * (Φ(x) + x φ(x))`, the exact derivative (φ the normal density), as a new vector.
///
/// # Panics
/// When `dy` is not as long as `x`.
pub fn backward(x: &[f32], dy: &[f32]) -> Vec<f32> {
    assert_eq!(x.len(), dy.len(), "gelu: dy for {} inputs", x.len());
    let fill = |dx: &mut [MaybeUninit<f32>]| {
        dx.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK)))
            .for_each(|(dx, (x, dy))| {
                #[cfg(target_arch = "x86_64")]
                if crate::x86::try_gelu_backward(x, dy, dx) {
                    return;
                }
                backward_chunk(x, dy, dx);
            });
    };
    // SAFETY: as in `forward`: equal chunks, each written in full.
    unsafe { written_by(x.len(), fill) }
}

/// [`forward`] and [`backward`] in one pass, for a backward pass that recomputes the GELU
/// instead of keeping it: returns `y = x * Φ(x)`, and `grad`, which holds `dy`, becomes `dx =
/// dy * (Φ(x) + x φ(x))` in place (no third buffer of the activation's size). Each `Φ(x)` is
/// computed once; the same bits as the two apart.
///
/// # Panics
/// When `grad` is not as long as `x`.
pub fn recompute_backward(x: &[f32], grad: &mut [f32]) -> Vec<f32> {
    assert_eq!(x.len(), grad.len(), "gelu: dy for {} inputs", x.len());
    let fill = |y: &mut [MaybeUninit<f32>]| {
        y.par_chunks_mut(CHUNK)
            .zip(grad.par_chunks_mut(CHUNK))
            .zip(x.par_chunks(CHUNK))
            .for_each(|((y, grad), x)| {
                #[cfg(target_arch = "x86_64")]
                if crate::x86::try_gelu_recompute_backward(x, y, grad) {
                    return;
                }
                recompute_backward_chunk(x, y, grad);
            });
    };
    // SAFETY: as in `forward`: equal chunks, each written in full.
    unsafe { written_by(x.len(), fill) }
}

/// [`forward`] of bf16 or f16 values (or f32): each chunk widened, computed in f32, and
/// rounded once, with no f32 copy of the whole tensor.
pub fn forward_half<T: Element>(x: &[T]) -> Vec<T> {
    let fill = |y: &mut [MaybeUninit<T>]| {
        y.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(y, x)| {
                // One chunk: `forward` computes it on this thread.
                crate::cast::store_sum(y, &forward(&widened(x)), None);
            });
    };
    // SAFETY: the chunks of `y` and `x` pair up one to one with equal lengths, `forward`'s
    // result is as long as its chunk of `x`, and `store_sum` writes every element of its
    // chunk of `y` (it asserts equal lengths).
    unsafe { written_by(x.len(), fill) }
}

/// [`backward`] of bf16 or f16 values (or f32), chunk by chunk in f32, each gradient rounded
/// once.
///
/// # Panics
/// When `dy` is not as long as `x`.
pub fn backward_half<T: Element>(x: &[T], dy: &[T]) -> Vec<T> {
    assert_eq!(x.len(), dy.len(), "gelu: dy for {} inputs", x.len());
    let fill = |dx: &mut [MaybeUninit<T>]| {
        dx.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK)))
            .for_each(|(dx, (x, dy))| {
                crate::cast::store_sum(dx, &backward(&widened(x), &widened(dy)), None);
            });
    };
    // SAFETY: as in `forward_half`: equal chunks, each written in full.
    unsafe { written_by(x.len(), fill) }
}

/// One chunk widened to f32 (f16 with F16C where the CPU has it).
fn widened<T: Element>(values: &[T]) -> Vec<f32> {
    let mut wide = vec![0.0f32; values.len()];
    crate::cast::widen_into(values, &mut wide);
    wide
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::bits;

    /// The half-precision GELU is the f32 GELU of the widened values, rounded once, forward
    /// and backward, across chunk boundaries.
    #[test]
    fn half_values_take_the_f32_gelu_rounded_once() {
        let n = 2 * CHUNK + 77;
        let x32 = crate::test_support::uniform(n, 31, 6.0);
        let dy32 = crate::test_support::uniform(n, 32, 2.0);
        let x: Vec<half::bf16> = x32.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let dy: Vec<half::bf16> = dy32.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let (wx, wdy) = (widened(&x), widened(&dy));
        let round =
            |v: Vec<f32>| -> Vec<half::bf16> { v.into_iter().map(half::bf16::from_f32).collect() };
        assert_eq!(forward_half(&x), round(forward(&wx)));
        assert_eq!(backward_half(&x, &dy), round(backward(&wx, &wdy)));
        let x: Vec<half::f16> = x32.iter().map(|&v| half::f16::from_f32(v)).collect();
        let y: Vec<half::f16> = forward_half(&x);
        let want: Vec<half::f16> = forward(&widened(&x))
            .into_iter()
            .map(half::f16::from_f32)
            .collect();
        assert_eq!(y, want);
    }

    /// The build the dispatch picks on this CPU (AVX-512 or AVX2 where it has them) computes
    /// the portable loop's bits: the same IEEE operations in the same order, wider. (`x86`'s
    /// tests run every build the CPU has.)
    #[test]
    fn the_dispatched_build_gives_the_portable_bits() {
        let x: Vec<f32> = (0..1_003).map(|i| -12.0 + i as f32 * 0.025).collect();
        let dy: Vec<f32> = x.iter().map(|v| 1.0 - v * 0.1).collect();
        // SAFETY: each portable loop writes every element of its output.
        let (y, dx) = unsafe {
            (
                written_by(x.len(), |y| forward_chunk(&x, y)),
                written_by(x.len(), |dx| backward_chunk(&x, &dy, dx)),
            )
        };
        assert_eq!(bits(&y), bits(&forward(&x)));
        assert_eq!(bits(&dx), bits(&backward(&x, &dy)));
    }

    /// Recomputing with the derivative in one pass gives the bits of the two passes apart, on
    /// 1, 2 and 3 threads.
    #[test]
    fn the_one_pass_recomputation_gives_both_passes_bits() {
        let n = 3 * CHUNK + 11;
        let x = crate::test_support::uniform(n, 7, 9.0);
        let dy = crate::test_support::uniform(n, 8, 1.0);
        let (y, dx) = (forward(&x), backward(&x, &dy));
        crate::test_support::assert_same_on_1_2_3_threads(|| {
            let mut dx_once = dy.clone();
            let y_once = recompute_backward(&x, &mut dx_once);
            assert_eq!(bits(&y_once), bits(&y));
            assert_eq!(bits(&dx_once), bits(&dx));
            bits(&dx_once)
        });
    }

    #[test]
    fn matches_the_exact_gelu_and_its_derivative() {
        let x: Vec<f32> = (0..40_001).map(|i| -20.0 + i as f32 * 0.001).collect();
        let y = forward(&x);
        let dx = backward(&x, &vec![1.0; x.len()]);
        for ((&x, &y), &dx) in x.iter().zip(&y).zip(&dx) {
            let x64 = f64::from(x);
            let cdf = 0.5 * libm::erfc(-x64 / std::f64::consts::SQRT_2);
            let want = x64 * cdf;
            // Relative to the value, the negative tail included down to 1e-37 (below, f32
            // underflows to 0): 1e-6, plus the f32 rounding of the exponent -x^2 / 2, about
            // 2^-24 * x^2 relative (up to 2e-5 where the tail is 1e-25).
            let relative = 1e-6 + 2.5e-7 * x64 * x64;
            assert!(
                (f64::from(y) - want).abs() <= relative * want.abs() + 1e-37,
                "gelu({x}) = {y}, want {want}"
            );
            let density = (-0.5 * x64 * x64).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let want = cdf + x64 * density;
            assert!(
                (f64::from(dx) - want).abs() <= 1e-6 * want.abs() + 1e-6,
                "gelu'({x}) = {dx}, want {want}"
            );
        }
    }
}
