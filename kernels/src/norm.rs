//! Sum of squares and the global L2 norm of a flat buffer.
//!
//! Squares are summed in `LANES` f32 accumulators over blocks of `BLOCK` elements, and the
//! block totals in f64. f32 lanes keep the inner loop at full SIMD width; flushing every block
//! bounds the f32 rounding error to what a few thousand additions can accumulate, so a norm over
//! hundreds of millions of gradients is as accurate as an f64 loop, at the speed of an f32 one.

use crate::LANES;

/// Elements summed in f32 before the block total is added in f64.
pub const BLOCK: usize = 4096;

/// Sum of the squares of `values`, accumulated as described in the module docs.
pub fn sum_of_squares(values: &[f32]) -> f64 {
    values.chunks(BLOCK).map(block_sum_of_squares).sum()
}

/// Euclidean (L2) norm of `values`: `sqrt(sum of squares)`, as f32.
///
/// A non-finite element makes the norm non-finite (`inf` or `NaN`), which is how callers detect
/// overflowed gradients.
pub fn l2_norm(values: &[f32]) -> f32 {
    sum_of_squares(values).sqrt() as f32
}

fn block_sum_of_squares(block: &[f32]) -> f64 {
    let mut lanes = [0.0_f32; LANES];
    let mut chunks = block.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += x * x;
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|&x| x * x).sum();
    lanes.iter().map(|&l| f64::from(l)).sum::<f64>() + f64::from(tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(values: &[f32]) -> f64 {
        values.iter().map(|&x| f64::from(x) * f64::from(x)).sum()
    }

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0)
            .collect()
    }

    #[test]
    fn matches_f64_reference_on_odd_lengths() {
        for n in [0, 1, 2, 15, 16, 17, 4095, 4096, 4097, 10_007, 1 << 20] {
            let v = values(n);
            let got = sum_of_squares(&v);
            let want = reference(&v);
            assert!(
                (got - want).abs() <= want * 1e-6,
                "n = {n}: got {got}, want {want}"
            );
        }
    }

    #[test]
    fn norm_of_a_pythagorean_pair_is_exact() {
        assert_eq!(l2_norm(&[3.0, 4.0]), 5.0);
        assert_eq!(l2_norm(&[]), 0.0);
    }

    #[test]
    fn non_finite_elements_poison_the_norm() {
        let mut v = values(5000);
        v[4321] = f32::INFINITY;
        assert!(l2_norm(&v).is_infinite());
        v[4321] = f32::NAN;
        assert!(l2_norm(&v).is_nan());
    }
}
