//! Drop-in replacements for burn-nn modules whose training step Burn's autodiff takes apart into
//! many single-core passes, computed by our fused CPU kernels on the Flex backend (forward and
//! backward in one parallel pass each) and by Burn's own operations on every other backend.
//!
//! Each module has burn-nn's config type, field names and record layout: a model switches with
//! a `use` line, and a checkpoint saved with one loads into the other.
//!
//! - [`LayerNorm`] / [`LayerNormConfig`]: one pass forward, one backward.
//! - [`MultiHeadAttention`] / [`MultiHeadAttentionConfig`] / [`MhaInput`] / [`MhaOutput`]: the
//!   scale, masks and softmax in one pass (one backward), and self-attention's three input
//!   projections as one matrix product; [`MultiHeadAttention::forward_context`] runs
//!   self-attention flash-style, never keeping the attention weights.
//! - [`PositionWiseFeedForward`] / [`PositionWiseFeedForwardConfig`]: with a vectorised,
//!   parallel exact GELU, fused into the second layer when there is no dropout (the GELU's
//!   output is recomputed in the backward pass, not kept).
//! - [`TransformerEncoder`] / [`TransformerEncoderConfig`] / [`TransformerEncoderInput`]:
//!   burn-nn's encoder made of the modules above.
//! - Free functions for hand-built models: [`linear`], [`layer_norm`], [`gelu`], [`attention`],
//!   [`cross_entropy`].
//!
//! Their linear layers are burn-nn's `Linear` (same record), applied through [`linear`].
//!
//! Every config has a `fused` field (default true, not part of the record): `false` computes
//! exactly as burn-nn does, for comparisons.
//!
//! ```
//! use accelerate_burn::burn::tensor::{Device, Tensor};
//! use accelerate_burn::nn::LayerNormConfig; // in place of burn::nn::LayerNormConfig
//!
//! let device = Device::default();
//! let norm = LayerNormConfig::new(4).init(&device);
//! let x = Tensor::<2>::from_floats([[1.0, 2.0, 3.0, 4.0]], &device);
//! let y = norm.forward(x);
//! let mean: f32 = y.clone().mean().into_scalar();
//! assert!(mean.abs() < 1e-6);
//! ```

mod attention;
mod feed_forward;
mod functional;
mod layer_norm;
mod transformer;

pub use attention::{MhaInput, MhaOutput, MultiHeadAttention, MultiHeadAttentionConfig};
pub use feed_forward::{PositionWiseFeedForward, PositionWiseFeedForwardConfig};
pub use functional::{attention, cross_entropy, gelu, linear};
pub use layer_norm::{LayerNorm, LayerNormConfig, layer_norm};
pub use transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput, TransformerEncoderLayer,
};

/// Whether `device` is Flex's (plain or under autodiff), where our CPU kernels run.
#[cfg(feature = "flex")]
pub(crate) fn on_flex(device: &burn::tensor::Device) -> bool {
    matches!(
        device.clone().inner().as_dispatch(),
        burn::backend::DispatchDevice::Flex(_)
    )
}

/// Whether `x`, the `weights` and the `bias` are all bf16, or all f16, on Flex: what the
/// linear layer's half-precision products take (autocast's types).
#[cfg(feature = "flex")]
pub(crate) fn all_half_on_flex<const D: usize>(
    x: &burn::tensor::Tensor<D>,
    weights: &[&burn::tensor::Tensor<2>],
    bias: Option<&burn::tensor::Tensor<1>>,
) -> bool {
    use burn::tensor::DType;
    let dtype = x.dtype();
    matches!(dtype, DType::BF16 | DType::F16)
        && weights.iter().all(|w| w.dtype() == dtype)
        && bias.is_none_or(|b| b.dtype() == dtype)
        && on_flex(&x.device())
}

/// Whether `x`, the `weights` and the `bias` are all f32 on Flex: what our kernels that keep
/// parameters (the linear layers) take; other types use Burn's operations.
#[cfg(feature = "flex")]
pub(crate) fn all_f32_on_flex<const D: usize>(
    x: &burn::tensor::Tensor<D>,
    weights: &[&burn::tensor::Tensor<2>],
    bias: Option<&burn::tensor::Tensor<1>>,
) -> bool {
    use burn::tensor::DType;
    x.dtype() == DType::F32
        && weights.iter().all(|w| w.dtype() == DType::F32)
        && bias.is_none_or(|b| b.dtype() == DType::F32)
        && on_flex(&x.device())
}

/// Whether our fused kernels compute `tensor`'s operation: on Flex, a float type (f16 and
/// bf16 computed in f32, see [`in_f32`]).
#[cfg(feature = "flex")]
fn fused_here<const D: usize>(tensor: &burn::tensor::Tensor<D>) -> bool {
    use burn::tensor::DType;
    matches!(tensor.dtype(), DType::F32 | DType::F16 | DType::BF16) && on_flex(&tensor.device())
}

/// `op` on `tensor` widened to f32 (the type our kernels compute in), its result narrowed back
/// to `tensor`'s type (both casts parallel, see [`cast`]).
#[cfg(feature = "flex")]
fn in_f32<const D: usize, const E: usize>(
    tensor: burn::tensor::Tensor<D>,
    op: impl FnOnce(burn::tensor::Tensor<D>) -> burn::tensor::Tensor<E>,
) -> burn::tensor::Tensor<E> {
    use burn::tensor::DType;
    let dtype = tensor.dtype();
    if dtype == DType::F32 {
        return op(tensor);
    }
    let out = op(cast(tensor, DType::F32));
    cast(out, dtype)
}

/// `a + b` of one shape (a residual connection): on Flex, two bf16 or two f16 tensors are
/// added by our parallel kernel, with the bits Flex gives (Flex adds half-precision values one
/// at a time on the calling thread); anything else as `a + b`.
pub(crate) fn add<const D: usize>(
    a: burn::tensor::Tensor<D>,
    b: burn::tensor::Tensor<D>,
) -> burn::tensor::Tensor<D> {
    #[cfg(feature = "flex")]
    {
        use burn::tensor::DType;
        let half = matches!(a.dtype(), DType::BF16 | DType::F16);
        if half && a.dtype() == b.dtype() && a.dims() == b.dims() && on_flex(&a.device()) {
            return crate::cpu_kernels::add(a, b);
        }
    }
    a + b
}

/// `tensor` as `dtype` (a float type), as `Tensor::cast`: on Flex, between f32, bf16 and f16,
/// our parallel conversion (forward and backward; Flex converts on the calling thread).
pub(crate) fn cast<const D: usize>(
    tensor: burn::tensor::Tensor<D>,
    dtype: burn::tensor::DType,
) -> burn::tensor::Tensor<D> {
    use burn::tensor::FloatDType;
    if tensor.dtype() == dtype {
        return tensor;
    }
    #[cfg(feature = "flex")]
    {
        use burn::tensor::DType;
        let ours = |t: DType| matches!(t, DType::F32 | DType::BF16 | DType::F16);
        if ours(tensor.dtype()) && ours(dtype) && on_flex(&tensor.device()) {
            return crate::cpu_kernels::cast(tensor, FloatDType::from(dtype));
        }
    }
    tensor.cast(FloatDType::from(dtype))
}

#[cfg(test)]
mod tests {
    /// The default device of a flex build, with and without autodiff, takes the fused path.
    #[cfg(feature = "flex")]
    #[test]
    fn flex_devices_take_the_fused_kernels() {
        let device = burn::tensor::Device::default();
        assert!(super::on_flex(&device));
        assert!(super::on_flex(&device.autodiff()));
    }

    /// Our parallel cast gives Burn's bits, forward and for the gradient it sends back, in
    /// every direction between f32, bf16 and f16 (autocast's casts of weights, inputs and
    /// outputs go through it).
    #[cfg(feature = "flex")]
    #[test]
    fn casts_equal_burns_forward_and_backward() {
        use burn::tensor::{DType, Distribution, Tensor};
        let device = burn::tensor::Device::default().autodiff();
        let types = [DType::F32, DType::BF16, DType::F16];
        for from in types {
            for to in types {
                let x = Tensor::<2>::random([37, 1500], Distribution::Normal(0.0, 3.0), &device)
                    .cast(from);
                let dy = Tensor::<2>::random([37, 1500], Distribution::Normal(0.0, 1.0), &device)
                    .cast(to);
                let run = |ours: bool| {
                    let x = x.clone().require_grad();
                    let y = if ours {
                        super::cast(x.clone(), to)
                    } else {
                        x.clone().cast(to)
                    };
                    let grads = (y.clone() * dy.clone()).sum().backward();
                    let dx = x.grad(&grads).expect("x's gradient");
                    (y.into_data(), dx.into_data())
                };
                let ((y, dx), (burn_y, burn_dx)) = (run(true), run(false));
                assert_eq!(y.dtype(), to, "{from:?} -> {to:?}");
                assert_eq!(y.as_bytes(), burn_y.as_bytes(), "{from:?} -> {to:?}");
                assert_eq!(
                    dx.dtype(),
                    burn_dx.dtype(),
                    "{from:?} -> {to:?}: gradient type"
                );
                assert_eq!(
                    dx.as_bytes(),
                    burn_dx.as_bytes(),
                    "{from:?} -> {to:?}: gradient"
                );
            }
        }
    }
}
