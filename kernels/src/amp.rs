//! Mixed-precision helpers over a flat f32 gradient buffer: the fused unscale-and-check pass of
//! dynamic loss scaling.
//!
//! After the backward pass of a scaled loss, every gradient must be divided by the scale, and
//! the step must be skipped if any gradient overflowed. Doing both in one pass reads and writes
//! the buffer once. Non-finite values are detected on the bits (exponent all ones), in lanes,
//! so the loop vectorises and has no branch.

use crate::LANES;

const EXPONENT: u32 = 0x7f80_0000;

/// Multiplies every value by `inv_scale` in place and returns true when any result is not
/// finite (an infinity or NaN: the step must be skipped). The multiplication still happens
/// everywhere, so the buffer is consistent either way.
pub fn unscale_and_check(values: &mut [f32], inv_scale: f32) -> bool {
    let mut flags = [0u32; LANES];
    let mut chunks = values.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (x, flag) in chunk.iter_mut().zip(flags.iter_mut()) {
            *x *= inv_scale;
            *flag |= u32::from(x.to_bits() & EXPONENT == EXPONENT);
        }
    }
    let mut tail = 0u32;
    for x in chunks.into_remainder() {
        *x *= inv_scale;
        tail |= u32::from(x.to_bits() & EXPONENT == EXPONENT);
    }
    flags.iter().fold(tail, |a, &b| a | b) != 0
}

/// True when any value is not finite (without changing them).
pub fn has_non_finite(values: &[f32]) -> bool {
    let mut flags = [0u32; LANES];
    let mut chunks = values.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (x, flag) in chunk.iter().zip(flags.iter_mut()) {
            *flag |= u32::from(x.to_bits() & EXPONENT == EXPONENT);
        }
    }
    let tail = chunks.remainder().iter().any(|x| !x.is_finite());
    tail || flags.iter().any(|&f| f != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize) -> Vec<f32> {
        (0..n).map(|i| (i as f32 - 50.0) * 1024.0).collect()
    }

    #[test]
    fn unscaling_matches_a_scalar_loop_on_odd_lengths() {
        for n in [0, 1, 15, 16, 17, 1000] {
            let v = values(n);
            let mut got = v.clone();
            assert!(!unscale_and_check(&mut got, 1.0 / 65536.0));
            let want: Vec<f32> = v.iter().map(|x| x * (1.0 / 65536.0)).collect();
            assert_eq!(got, want, "n = {n}");
            assert!(!has_non_finite(&got));
        }
    }

    #[test]
    fn any_infinity_or_nan_anywhere_is_found() {
        for n in [1, 15, 16, 17, 1000] {
            for at in [0, n / 2, n - 1] {
                for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                    let mut v = values(n);
                    v[at] = bad;
                    assert!(has_non_finite(&v), "n {n} at {at} {bad}");
                    assert!(unscale_and_check(&mut v, 0.5), "n {n} at {at} {bad}");
                }
            }
        }
        // The largest finite values are finite.
        let mut v = vec![f32::MAX, -f32::MAX, f32::MIN_POSITIVE];
        assert!(!unscale_and_check(&mut v, 1.0));
    }
}
