//! Layer normalisation: burn-nn's `LayerNorm`, with our fused kernel on Flex.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Initializer;
use burn::tensor::{DType, Device, FloatDType, Tensor};

/// Configuration of a [`LayerNorm`], as burn-nn's `LayerNormConfig`.
#[derive(Debug, Config)]
pub struct LayerNormConfig {
    /// The size of the input features.
    pub d_model: usize,
    /// A value required for numerical stability. Default: 1e-5
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// If a bias (beta) should be applied during the normalization. Default: true
    #[config(default = true)]
    pub bias: bool,
    /// Our fused kernel where it runs (Flex); `false` computes as burn-nn does everywhere
    /// (for comparisons). Not part of the record. Default: true
    #[config(default = true)]
    pub fused: bool,
}

/// Layer normalisation over the last dimension, `y = norm(x) * gamma + beta`, as burn-nn's
/// `LayerNorm` (same fields and record), fused on Flex.
#[derive(Module, Debug)]
pub struct LayerNorm {
    /// The learnable weight (scale).
    pub gamma: Param<Tensor<1>>,
    /// The learnable bias (optional).
    pub beta: Option<Param<Tensor<1>>>,
    /// A value required for numerical stability.
    epsilon: f64,
    /// Whether the fused kernel is used where it runs.
    fused: bool,
}

impl LayerNormConfig {
    /// Initializes a new layer norm module: gamma ones, beta zeros.
    pub fn init(&self, device: &Device) -> LayerNorm {
        LayerNorm {
            gamma: Initializer::Ones.init([self.d_model], device),
            beta: self
                .bias
                .then(|| Initializer::Zeros.init([self.d_model], device)),
            epsilon: self.epsilon,
            fused: self.fused,
        }
    }
}

impl LayerNorm {
    /// Normalises `input` (`[..., d_model]`) over its last dimension.
    ///
    /// # Panics
    /// When the last dimension of `input` is not `d_model` (as burn-nn's).
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let [d_model] = self.gamma.dims();
        let last = input.dims()[D - 1];
        assert_eq!(
            last, d_model,
            "LayerNorm of {d_model} features given an input whose last dimension is {last}"
        );
        let (gamma, beta) = (self.gamma.val(), self.beta.as_ref().map(Param::val));
        if self.fused {
            layer_norm(input, gamma, beta, self.epsilon)
        } else {
            burn_layer_norm(input, gamma, beta, self.epsilon)
        }
    }

    /// The epsilon added to the variance.
    pub fn epsilon(&self) -> f64 {
        self.epsilon
    }
}

/// Layer norm of `x` over its last dimension with `gamma` and optional `beta`, as Burn's
/// `burn::tensor::module::layer_norm` under burn-nn's `LayerNorm` (f16 computed in f32). On
/// Flex, our fused kernel in f32 (half-precision inputs are widened for it and the result
/// narrowed back); elsewhere, Burn's operations.
///
/// # Panics
/// When `gamma` or `beta` does not have one element per entry of `x`'s last dimension (a
/// shape error, as Burn's operations panic on).
pub fn layer_norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    epsilon: f64,
) -> Tensor<D> {
    let width = x.dims()[D - 1];
    for (name, len) in [
        ("gamma", Some(gamma.dims()[0])),
        ("beta", beta.as_ref().map(|b| b.dims()[0])),
    ] {
        if let Some(len) = len {
            assert_eq!(
                len, width,
                "layer_norm: {name} has {len} elements for an input whose last dimension is {width}"
            );
        }
    }
    #[cfg(feature = "flex")]
    if super::fused_here(&x) {
        // In x's type (bf16 and f16 computed in f32 inside, kept in their own type).
        let beta = beta.unwrap_or_else(|| gamma.zeros_like());
        let dtype = x.dtype();
        let (gamma, beta) = (super::cast(gamma, dtype), super::cast(beta, dtype));
        return crate::cpu_kernels::layer_norm(x, gamma, beta, epsilon);
    }
    burn_layer_norm(x, gamma, beta, epsilon)
}

/// Layer norm as burn-nn computes it: Burn's operation, f16 widened to f32 (its range cannot
/// hold the sum of squares), bf16 left alone.
fn burn_layer_norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    epsilon: f64,
) -> Tensor<D> {
    if x.dtype() == DType::F16 {
        let f32 = FloatDType::F32;
        return burn::tensor::module::layer_norm(
            x.cast(f32),
            gamma.cast(f32),
            beta.map(|b| b.cast(f32)),
            epsilon,
        )
        .cast(FloatDType::F16);
    }
    burn::tensor::module::layer_norm(x, gamma, beta, epsilon)
}
