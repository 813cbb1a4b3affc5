//! The transformer encoder: burn-nn's `TransformerEncoder` (same config, fields and record),
//! made of this crate's [`LayerNorm`](super::LayerNorm),
//! [`MultiHeadAttention`](super::MultiHeadAttention) and
//! [`PositionWiseFeedForward`](super::PositionWiseFeedForward).

use burn::config::Config;
use burn::module::Module;
use burn::nn::activation::ActivationConfig;
use burn::nn::{Dropout, DropoutConfig, Initializer};
use burn::tensor::{Bool, Device, Tensor};

use crate::sharded::Unit;

use super::{
    LayerNorm, LayerNormConfig, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig,
    PositionWiseFeedForward, PositionWiseFeedForwardConfig,
};

/// Configuration of a [`TransformerEncoder`], as burn-nn's `TransformerEncoderConfig`.
#[derive(Config, Debug)]
pub struct TransformerEncoderConfig {
    /// The size of the model.
    pub d_model: usize,
    /// The size of the position-wise feed-forward network.
    pub d_ff: usize,
    /// The number of attention heads.
    pub n_heads: usize,
    /// The number of layers.
    pub n_layers: usize,
    /// The dropout rate. Default: 0.1
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Layer norm before each sub-layer (pre-norm) instead of after. Default: false
    #[config(default = false)]
    pub norm_first: bool,
    /// Use "quiet softmax" in attention. Default: false
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// How parameters are initialised (burn-nn's default).
    #[config(
        default = "Initializer::KaimingUniform{gain: 1.0 / f64::sqrt(3.0), fan_out_only: false}"
    )]
    pub initializer: Initializer,
    /// The activation of the feed-forward network. Default: Gelu
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    /// The epsilon of the layer norms. Default: 1e-5
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
    /// Our fused kernels where they run (see [`LayerNormConfig::fused`]). Default: true
    #[config(default = true)]
    pub fused: bool,
}

/// A stack of transformer encoder layers, as burn-nn's `TransformerEncoder`. `L` is a layer
/// unit: the layer itself, or a [`Sharded`](crate::Sharded) layer (ZeRO-3, see
/// [`map_layers`](Self::map_layers)).
#[derive(Module, Debug)]
pub struct TransformerEncoder<L: Module = TransformerEncoderLayer> {
    /// The layers.
    pub layers: Vec<L>,
    /// The size of the model.
    pub d_model: usize,
    /// The size of the position-wise feed-forward network.
    pub d_ff: usize,
    /// The number of attention heads.
    pub n_heads: usize,
    /// The number of layers.
    pub n_layers: usize,
    /// The dropout rate.
    pub dropout: f64,
    /// Pre-norm (true) or post-norm layers.
    pub norm_first: bool,
    /// Quiet softmax in attention.
    pub quiet_softmax: bool,
}

/// The input of [`TransformerEncoder::forward`]: the sequence and optional masks.
#[derive(Debug)]
pub struct TransformerEncoderInput {
    tensor: Tensor<3>,
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<Tensor<3, Bool>>,
}

impl TransformerEncoderInput {
    /// The input `[batch, seq, d_model]` without masks.
    pub fn new(tensor: Tensor<3>) -> Self {
        Self {
            tensor,
            mask_pad: None,
            mask_attn: None,
        }
    }

    /// Adds the padding mask `[batch, seq]` (true: padding).
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// Adds the attention mask `[batch, seq, seq]` (true: masked).
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }
}

impl TransformerEncoderConfig {
    /// Initialises the encoder.
    pub fn init(&self, device: &Device) -> TransformerEncoder {
        TransformerEncoder {
            layers: (0..self.n_layers)
                .map(|_| TransformerEncoderLayer::new(self, device))
                .collect(),
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            dropout: self.dropout,
            norm_first: self.norm_first,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

impl<L: Unit<TransformerEncoderLayer>> TransformerEncoder<L> {
    /// `[batch, seq, d_model]` through every layer (each gathered in turn when the layers are
    /// sharded).
    pub fn forward(&self, input: TransformerEncoderInput) -> Tensor<3> {
        self.layers.iter().fold(input.tensor, |x, layer| {
            layer
                .whole_for(&x)
                .forward(x, input.mask_pad.clone(), input.mask_attn.clone())
        })
    }
}

impl<L: Module> TransformerEncoder<L> {
    /// The same encoder with each layer made another unit by `f` (for example sharded with
    /// [`Accelerator::shard`](crate::Accelerator::shard), or gathered whole with
    /// [`Unit::whole`]).
    pub fn map_layers<L2: Module, E>(
        self,
        f: impl FnMut(L) -> Result<L2, E>,
    ) -> Result<TransformerEncoder<L2>, E> {
        Ok(TransformerEncoder {
            layers: self.layers.into_iter().map(f).collect::<Result<_, E>>()?,
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            dropout: self.dropout,
            norm_first: self.norm_first,
            quiet_softmax: self.quiet_softmax,
        })
    }
}

/// One encoder layer, as burn-nn's `TransformerEncoderLayer`: self-attention and a
/// feed-forward network, each with a residual connection and a layer norm.
#[derive(Module, Debug)]
pub struct TransformerEncoderLayer {
    /// Multi-head self-attention.
    pub mha: MultiHeadAttention,
    /// The position-wise feed-forward network.
    pub pwff: PositionWiseFeedForward,
    /// The norm around the feed-forward network.
    pub norm_1: LayerNorm,
    /// The norm around attention (pre-norm) or after the layer (post-norm).
    pub norm_2: LayerNorm,
    /// Dropout on both residual branches.
    pub dropout: Dropout,
    /// Pre-norm (true) or post-norm.
    pub norm_first: bool,
}

impl TransformerEncoderLayer {
    /// A layer of `config`.
    pub fn new(config: &TransformerEncoderConfig, device: &Device) -> Self {
        let norm = || {
            LayerNormConfig::new(config.d_model)
                .with_epsilon(config.layer_norm_eps)
                .with_fused(config.fused)
                .init(device)
        };
        Self {
            mha: MultiHeadAttentionConfig::new(config.d_model, config.n_heads)
                .with_initializer(config.initializer.clone())
                .with_dropout(config.dropout)
                .with_quiet_softmax(config.quiet_softmax)
                .with_fused(config.fused)
                .init(device),
            pwff: PositionWiseFeedForwardConfig::new(config.d_model, config.d_ff)
                .with_initializer(config.initializer.clone())
                .with_dropout(config.dropout)
                .with_activation(config.activation.clone())
                .with_fused(config.fused)
                .init(device),
            norm_1: norm(),
            norm_2: norm(),
            dropout: DropoutConfig::new(config.dropout).init(),
            norm_first: config.norm_first,
        }
    }

    /// `[batch, seq, d_model]` through the layer, in burn-nn's order of operations.
    pub fn forward(
        &self,
        x: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        let attended = if self.norm_first {
            self.norm_2.forward(x.clone())
        } else {
            x.clone()
        };
        let mut input = MhaInput::self_attn(attended);
        if let Some(mask) = mask_pad {
            input = input.mask_pad(mask);
        }
        if let Some(mask) = mask_attn {
            input = input.mask_attn(mask);
        }
        let x = super::add(x, self.dropout.forward(self.mha.forward_context(input)));
        let (x, branch) = if self.norm_first {
            let branch = self.norm_1.forward(x.clone());
            (x, branch)
        } else {
            let x = self.norm_1.forward(x);
            (x.clone(), x)
        };
        let x = super::add(x, self.dropout.forward(self.pwff.forward(branch)));
        if self.norm_first {
            x
        } else {
            self.norm_2.forward(x)
        }
    }
}
