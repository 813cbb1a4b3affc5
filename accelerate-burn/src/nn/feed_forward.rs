//! The position-wise feed-forward network: burn-nn's `PositionWiseFeedForward` (same config,
//! fields and record), with the fused [`gelu`](super::gelu) when its activation is the exact
//! GELU, and on Flex without dropout the GELU and the second layer as one operation that keeps
//! only the GELU's input for the backward pass.

use burn::config::Config;
use burn::module::Module;
use burn::nn::activation::{Activation, ActivationConfig};
use burn::nn::{Dropout, DropoutConfig, Initializer, Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

/// Configuration of a [`PositionWiseFeedForward`], as burn-nn's.
#[derive(Config, Debug)]
pub struct PositionWiseFeedForwardConfig {
    /// The size of the input and output features.
    pub d_model: usize,
    /// The size of the hidden inner features.
    pub d_ff: usize,
    /// The dropout rate. Default: 0.1
    #[config(default = 0.1)]
    pub dropout: f64,
    /// How parameters are initialised (burn-nn's default).
    #[config(
        default = "Initializer::KaimingUniform{gain: 1.0 / f64::sqrt(3.0), fan_out_only: false}"
    )]
    pub initializer: Initializer,
    /// The activation between the two layers. Default: Gelu
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    /// The fused GELU where it runs (Flex); `false` computes as burn-nn does. Not part of
    /// the record. Default: true
    #[config(default = true)]
    pub fused: bool,
}

/// `linear_outer(dropout(activation(linear_inner(x))))`, as burn-nn's module.
#[derive(Module, Debug)]
pub struct PositionWiseFeedForward {
    /// The first layer, `d_model -> d_ff`.
    pub linear_inner: Linear,
    /// The second layer, `d_ff -> d_model`.
    pub linear_outer: Linear,
    /// Dropout after the activation.
    pub dropout: Dropout,
    /// The activation (not in the record, as in burn-nn).
    #[module(skip)]
    pub activation: Activation,
    /// Whether the fused GELU is used where it runs.
    fused: bool,
}

impl PositionWiseFeedForwardConfig {
    /// Initialises the network.
    pub fn init(&self, device: &Device) -> PositionWiseFeedForward {
        PositionWiseFeedForward {
            linear_inner: LinearConfig::new(self.d_model, self.d_ff)
                .with_initializer(self.initializer.clone())
                .init(device),
            linear_outer: LinearConfig::new(self.d_ff, self.d_model)
                .with_initializer(self.initializer.clone())
                .init(device),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: self.activation.init(device),
            fused: self.fused,
        }
    }
}

impl PositionWiseFeedForward {
    /// `[..., d_model]` through the network.
    ///
    /// # Panics
    /// When the last dimension of `input` is not `d_model` (as burn-nn's).
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let [d_model, _] = self.linear_inner.weight.dims();
        let last = input.dims()[D - 1];
        assert_eq!(
            last, d_model,
            "PositionWiseFeedForward: input's last dimension is {last}, the network's d_model {d_model}"
        );
        let x = super::functional::linear_layer(&self.linear_inner, input, self.fused);
        let exact_gelu = matches!(&self.activation, Activation::Gelu(gelu) if !gelu.approximate);
        #[cfg(feature = "flex")]
        if self.fused
            && exact_gelu
            && self.dropout.prob == 0.0
            && let Some((weight, bias)) = self.outer_fusing_with(&x)
        {
            return crate::cpu_kernels::gelu_linear(x, weight, bias);
        }
        let x = if self.fused && exact_gelu {
            super::gelu(x)
        } else {
            self.activation.forward(x)
        };
        super::functional::linear_layer(&self.linear_outer, self.dropout.forward(x), self.fused)
    }

    /// The second layer's weight and bias when the GELU and that layer run as one operation
    /// on `hidden`: f32 on Flex, as are the parameters, and a bias (burn-nn's always has one).
    /// The GELU's output, the widest activation of the network, is then recomputed in the
    /// backward pass instead of kept.
    #[cfg(feature = "flex")]
    fn outer_fusing_with<const D: usize>(
        &self,
        hidden: &Tensor<D>,
    ) -> Option<(Tensor<2>, Tensor<1>)> {
        let weight = self.linear_outer.weight.val();
        let bias = self.linear_outer.bias.as_ref()?.val();
        super::all_f32_on_flex(hidden, &[&weight], Some(&bias)).then_some((weight, bias))
    }
}
