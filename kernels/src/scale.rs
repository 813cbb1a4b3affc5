//! In-place scaling of a flat buffer and the global-norm clipping coefficient.

use crate::LANES;

/// Multiplies every element of `values` by `factor`, in place.
pub fn scale_in_place(values: &mut [f32], factor: f32) {
    let mut chunks = values.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for x in chunk {
            *x *= factor;
        }
    }
    for x in chunks.into_remainder() {
        *x *= factor;
    }
}

/// The factor by which gradients with global norm `norm` are multiplied so that their norm is
/// at most `max_norm`: `min(1, max_norm / (norm + 1e-6))`, PyTorch's `clip_grad_norm_` formula.
///
/// As in PyTorch, a NaN `norm` gives a NaN coefficient and an infinite one gives 0 (which turns
/// the infinite gradients into NaN): an overflowed step stays visibly poisoned instead of being
/// clipped to a finite but meaningless update.
pub fn clip_coefficient(norm: f32, max_norm: f32) -> f32 {
    let coefficient = max_norm / (norm + 1e-6);
    // Not `min`: it would turn a NaN coefficient into 1 and hide the poisoned step.
    if coefficient >= 1.0 { 1.0 } else { coefficient }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_matches_scalar_loop_on_odd_lengths() {
        for n in [0, 1, 15, 16, 17, 1001] {
            let v: Vec<f32> = (0..n).map(|i| i as f32 - 7.5).collect();
            let mut got = v.clone();
            scale_in_place(&mut got, 0.375);
            let want: Vec<f32> = v.iter().map(|x| x * 0.375).collect();
            assert_eq!(got, want, "n = {n}");
        }
    }

    #[test]
    fn clip_coefficient_never_grows_gradients() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        let c = clip_coefficient(10.0, 1.0);
        assert!((c - 0.1).abs() < 1e-7);
        assert!(clip_coefficient(f32::INFINITY, 1.0) == 0.0);
        assert!(clip_coefficient(f32::NAN, 1.0).is_nan());
    }
}
