//! What the row-wise kernels ([`crate::layer_norm`], [`crate::softmax`],
//! [`crate::cross_entropy`], [`crate::gelu`]) share: the shape of a row-major buffer, sums in
//! fixed lanes (the same bits on every run, and loops the compiler vectorises), and an `exp`
//! without branches or tables that vectorises too (glibc's `expf` is a scalar call per element,
//! and takes a slow path for the very negative arguments masked attention scores give).

use crate::LANES;

/// The extent of the buffers: `rows` rows of `width` elements, each operated on along `width`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Rows (every dimension but the last, multiplied).
    pub rows: usize,
    /// Elements per row (the dimension the operation runs along).
    pub width: usize,
}

/// Sum of `values` in [`LANES`] f32 accumulators (vectorises; the order is fixed).
pub(crate) fn lane_sum(values: &[f32]) -> f32 {
    let mut lanes = [0.0_f32; LANES];
    let mut chunks = values.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += v;
        }
    }
    lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// Sum of `(v - mean)^2` over `values`, in lanes like [`lane_sum`].
pub(crate) fn lane_centred_squares(values: &[f32], mean: f32) -> f32 {
    let mut lanes = [0.0_f32; LANES];
    let mut chunks = values.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            let c = v - mean;
            *lane += c * c;
        }
    }
    let tail: f32 = chunks
        .remainder()
        .iter()
        .map(|&v| (v - mean) * (v - mean))
        .sum();
    lanes.iter().sum::<f32>() + tail
}

/// Sums of `a` and of `a * b`, in lanes like [`lane_sum`].
pub(crate) fn lane_sum_and_dot(a: &[f32], b: &[f32]) -> (f32, f32) {
    let mut sums = [0.0_f32; LANES];
    let mut dots = [0.0_f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (xa, xb) in (&mut ca).zip(&mut cb) {
        for (((s, d), &va), &vb) in sums.iter_mut().zip(dots.iter_mut()).zip(xa).zip(xb) {
            *s += va;
            *d += va * vb;
        }
    }
    let mut sum = sums.iter().sum::<f32>();
    let mut dot = dots.iter().sum::<f32>();
    for (&va, &vb) in ca.remainder().iter().zip(cb.remainder()) {
        sum += va;
        dot += va * vb;
    }
    (sum, dot)
}

/// Largest of `values` (`-inf` for none), in lanes like [`lane_sum`]. A NaN is ignored, as
/// `f32::max` ignores it.
pub(crate) fn lane_max(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = values.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(v);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    lanes.iter().fold(tail, |m, &v| m.max(v))
}

/// `e^x` in f32, within about 2 ulp of the exact value for normal results; 0 below -87 (where
/// the exact value is below 2^-125) and `e^88` above 88 (callers subtract a maximum first, so
/// their arguments are at most 0). NaN gives NaN.
///
/// Cephes' `expf` scheme: `x = n ln2 + r` with `|r| <= ln2 / 2` (n rounded by the 1.5 * 2^23
/// trick, which needs no rounding instruction), a degree-5 polynomial for `e^r`, and `2^n`
/// built from its exponent bits. No branch and no table, so loops over it vectorise.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    exp_by(x, |a, b, c| a * b + c)
}

/// [`exp`] with every multiply-add fused (`f32::mul_add`: one rounding, so the same bits on
/// every target; fast only where the target has FMA, slow through libm's `fmaf` elsewhere).
#[inline(always)]
pub(crate) fn exp_fused(x: f32) -> f32 {
    exp_by(x, f32::mul_add)
}

/// [`exp`]'s arithmetic with `madd(a, b, c)` for each `a * b + c`.
#[inline(always)]
fn exp_by(x: f32, madd: impl Fn(f32, f32, f32) -> f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds a float of magnitude below 2^22 to an integer, which then
    // sits in the low bits of the sum's mantissa.
    const ROUNDER: f32 = 12_582_912.0;
    let clamped = x.clamp(-87.0, 88.0);
    let shifted = madd(clamped, std::f32::consts::LOG2_E, ROUNDER);
    let n = shifted - ROUNDER;
    // `clamped - n ln2`, in two parts; `-n * h + c` is `c - n * h` to the bit.
    let r = madd(-n, LN2_LO, madd(-n, LN2_HI, clamped));
    let poly = [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ]
    .into_iter()
    .fold(1.987_569_1e-4, |acc, c| madd(acc, r, c));
    let e_r = madd(poly, r * r, r) + 1.0;
    // n is in [-126, 127] after the clamp: `n + 127` is a normal float's biased exponent.
    let n_bits = shifted.to_bits().wrapping_sub(ROUNDER.to_bits());
    let two_n = f32::from_bits(n_bits.wrapping_add(127) << 23);
    let value = e_r * two_n;
    if x < -87.0 { 0.0 } else { value }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both builds of the exponential, plain and with fused multiply-adds.
    #[test]
    fn exp_is_within_two_ulp_of_f64s_exp() {
        let builds = [("exp", exp as fn(f32) -> f32), ("exp_fused", exp_fused)];
        for (name, exp) in builds {
            let mut x = -87.0_f32;
            let mut worst = 0.0_f64;
            while x <= 88.0 {
                let want = f64::from(x).exp();
                let got = f64::from(exp(x));
                let ulp = f64::from(f32::EPSILON) * want;
                worst = worst.max((got - want).abs() / ulp);
                x += 0.001_37;
            }
            assert!(worst <= 2.0, "{name}: worst error {worst} ulp");
            assert_eq!(exp(0.0), 1.0, "{name}");
            assert_eq!(exp(-87.5), 0.0, "{name}");
            assert_eq!(exp(-1.0e4), 0.0, "{name}");
            assert_eq!(exp(f32::NEG_INFINITY), 0.0, "{name}");
            assert!(exp(f32::NAN).is_nan(), "{name}");
        }
    }

    #[test]
    fn lane_max_ignores_nan_and_sees_every_element() {
        let mut values: Vec<f32> = (0..37).map(|i| i as f32).collect();
        values[36] = 100.0;
        values[3] = f32::NAN;
        assert_eq!(lane_max(&values), 100.0);
        assert_eq!(lane_max(&[]), f32::NEG_INFINITY);
    }
}
