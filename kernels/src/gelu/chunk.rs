//! The GELU's loops over one chunk, on one thread: the portable code, which the AVX2 and
//! AVX-512 builds in `x86` inline too. Every multiply-add is fused (`f32::mul_add`, one
//! rounding), so each build computes the same bits: with FMA instructions in the vector builds
//! (a third fewer operations than separate products and sums), through libm's `fmaf` in the
//! portable loop where the target has no FMA (correct, slower; x86 CPUs with AVX2 and FMA take a
//! vector build).

use std::mem::MaybeUninit;

use crate::rows::exp_fused as exp;

/// `1 / sqrt(2)`.
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;

/// `erfc(z)` for `z >= 0`, relative error about 1e-7 (Numerical Recipes' `erfcc`, a Chebyshev
/// fit of `erfc(z) e^{z^2} (1 + z / 2)`).
#[inline(always)]
fn erfc_non_negative(z: f32) -> f32 {
    let t = 1.0 / 0.5_f32.mul_add(z, 1.0);
    // Horner's scheme from the highest coefficient down.
    let poly = [
        -0.822_152_23,
        1.488_515_9,
        -1.135_204,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_7,
        -1.265_512_2,
    ]
    .into_iter()
    .fold(0.170_872_77_f32, |acc, c| acc.mul_add(t, c));
    t * exp((-z).mul_add(z, poly))
}

/// `Φ(x)`, the standard normal distribution function: `erfc(-x / sqrt 2) / 2`.
#[inline(always)]
fn normal_cdf(x: f32) -> f32 {
    let half_tail = 0.5 * erfc_non_negative(x.abs() * FRAC_1_SQRT_2);
    if x >= 0.0 { 1.0 - half_tail } else { half_tail }
}

/// [`forward`](super::forward) on one chunk, on this thread (inlined into the AVX2 build in `x86`).
#[inline(always)]
pub(crate) fn forward_chunk(x: &[f32], y: &mut [MaybeUninit<f32>]) {
    for (y, &x) in y.iter_mut().zip(x) {
        y.write(x * normal_cdf(x));
    }
}

/// [`backward`](super::backward) on one chunk, on this thread (inlined into the AVX2 build in `x86`).
#[inline(always)]
pub(crate) fn backward_chunk(x: &[f32], dy: &[f32], dx: &mut [MaybeUninit<f32>]) {
    for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
        dx.write(dy * x.mul_add(density(x), normal_cdf(x)));
    }
}

/// [`recompute_backward`](super::recompute_backward) on one chunk, on this thread (inlined into the AVX2 build in `x86`).
#[inline(always)]
pub(crate) fn recompute_backward_chunk(x: &[f32], y: &mut [MaybeUninit<f32>], grad: &mut [f32]) {
    for ((y, grad), &x) in y.iter_mut().zip(grad.iter_mut()).zip(x) {
        let cdf = normal_cdf(x);
        y.write(x * cdf);
        *grad *= x.mul_add(density(x), cdf);
    }
}

/// `φ(x)`, the standard normal density.
#[inline(always)]
fn density(x: f32) -> f32 {
    // 1 / sqrt(2 pi)
    const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
    FRAC_1_SQRT_2PI * exp(-0.5 * x * x)
}
