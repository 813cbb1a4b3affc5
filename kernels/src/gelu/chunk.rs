//! The GELU's loops over one chunk, on one thread: the portable code, which the AVX2 build in
//! `x86` inlines too (the same operations in the same order, so the same bits).

use crate::rows::exp;

/// `1 / sqrt(2)`.
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;

/// `erfc(z)` for `z >= 0`, relative error about 1e-7 (Numerical Recipes' `erfcc`, a Chebyshev
/// fit of `erfc(z) e^{z^2} (1 + z / 2)`).
#[inline(always)]
fn erfc_non_negative(z: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_204
                                + t * (1.488_515_9 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    t * exp(poly - z * z)
}

/// `Φ(x)`, the standard normal distribution function: `erfc(-x / sqrt 2) / 2`.
#[inline(always)]
fn normal_cdf(x: f32) -> f32 {
    let half_tail = 0.5 * erfc_non_negative(x.abs() * FRAC_1_SQRT_2);
    if x >= 0.0 { 1.0 - half_tail } else { half_tail }
}

/// [`forward`](super::forward) on one chunk, on this thread (inlined into the AVX2 build in `x86`).
#[inline(always)]
pub(crate) fn forward_chunk(x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = x * normal_cdf(x);
    }
}

/// [`backward`](super::backward) on one chunk, on this thread (inlined into the AVX2 build in `x86`).
#[inline(always)]
pub(crate) fn backward_chunk(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
        *dx = dy * (normal_cdf(x) + x * density(x));
    }
}

/// [`recompute_backward`](super::recompute_backward) on one chunk, on this thread (inlined into the AVX2 build in `x86`).
#[inline(always)]
pub(crate) fn recompute_backward_chunk(x: &[f32], y: &mut [f32], grad: &mut [f32]) {
    for ((y, grad), &x) in y.iter_mut().zip(grad.iter_mut()).zip(x) {
        let cdf = normal_cdf(x);
        *y = x * cdf;
        *grad *= cdf + x * density(x);
    }
}

/// `φ(x)`, the standard normal density.
#[inline(always)]
fn density(x: f32) -> f32 {
    // 1 / sqrt(2 pi)
    const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
    FRAC_1_SQRT_2PI * exp(-0.5 * x * x)
}
