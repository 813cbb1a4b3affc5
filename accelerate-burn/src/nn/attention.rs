//! Multi-head attention: burn-nn's `MultiHeadAttention` (same config, fields and record), with
//! the fused attention softmax (scale, masks and softmax in one pass, one backward pass) and,
//! for self-attention, the three input projections as one matrix product; `forward_context`
//! (the context without the weights) runs self-attention as one flash-style operation.

use burn::config::Config;
use burn::module::Module;
use burn::nn::activation::Gelu;
use burn::nn::{Dropout, DropoutConfig, Initializer, Linear, LinearConfig};
use burn::tensor::{Bool, Device, Tensor};

use super::functional::{AttentionSoftmax, attention_weights};

/// Configuration of a [`MultiHeadAttention`], as burn-nn's `MultiHeadAttentionConfig`.
#[derive(Config, Debug)]
pub struct MultiHeadAttentionConfig {
    /// The size of each linear layer.
    pub d_model: usize,
    /// The number of heads.
    pub n_heads: usize,
    /// The dropout rate. Default: 0.1
    #[config(default = 0.1)]
    pub dropout: f64,
    /// The value masked scores take before the softmax. Default: -1.0e4
    #[config(default = -1.0e4)]
    pub min_float: f64,
    /// Use "quiet softmax" instead of softmax. Default: false
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// How parameters are initialised (burn-nn's default).
    #[config(
        default = "Initializer::KaimingUniform{gain: 1.0 / f64::sqrt(3.0), fan_out_only: false}"
    )]
    pub initializer: Initializer,
    /// A bias on the key projection. Default: true
    #[config(default = true)]
    pub key_bias: bool,
    /// A bias on the value projection. Default: true
    #[config(default = true)]
    pub value_bias: bool,
    /// A bias on the query projection. Default: true
    #[config(default = true)]
    pub query_bias: bool,
    /// A bias on the output projection. Default: true
    #[config(default = true)]
    pub output_bias: bool,
    /// Our fused softmax and single input product where they run (Flex); `false` computes
    /// as burn-nn does. Not part of the record. Default: true
    #[config(default = true)]
    pub fused: bool,
}

/// Multi-head attention, as burn-nn's `MultiHeadAttention`.
#[derive(Module, Debug)]
pub struct MultiHeadAttention {
    /// The query projection.
    pub query: Linear,
    /// The key projection.
    pub key: Linear,
    /// The value projection.
    pub value: Linear,
    /// The output projection.
    pub output: Linear,
    /// Dropout on the attention weights.
    pub dropout: Dropout,
    /// Unused, kept for burn-nn's record layout.
    pub activation: Gelu,
    /// The size of the model.
    pub d_model: usize,
    /// The number of heads.
    pub n_heads: usize,
    /// The size of each head.
    pub d_k: usize,
    /// The value masked scores take.
    pub min_float: f64,
    /// Quiet softmax.
    pub quiet_softmax: bool,
    /// Whether the fused path is used where it runs.
    fused: bool,
}

/// The input of [`MultiHeadAttention::forward`], as burn-nn's `MhaInput`.
#[derive(Debug, Clone)]
pub struct MhaInput {
    query: Tensor<3>,
    key: Tensor<3>,
    value: Tensor<3>,
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<Tensor<3, Bool>>,
    /// Query, key and value are one tensor: one product projects all three.
    self_attention: bool,
}

impl MhaInput {
    /// Self-attention: `tensor` `[batch, seq, d_model]` is the query, key and value.
    pub fn self_attn(tensor: Tensor<3>) -> Self {
        Self {
            query: tensor.clone(),
            key: tensor.clone(),
            value: tensor,
            mask_pad: None,
            mask_attn: None,
            self_attention: true,
        }
    }

    /// Query `[batch, seq, d_model]`, key and value `[batch, keys, d_model]`.
    pub fn new(query: Tensor<3>, key: Tensor<3>, value: Tensor<3>) -> Self {
        Self {
            query,
            key,
            value,
            mask_pad: None,
            mask_attn: None,
            self_attention: false,
        }
    }

    /// Adds the padding mask `[batch, keys]` (true: padding).
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// Adds the attention mask `[batch, seq, keys]` (true: masked).
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }
}

/// The output of [`MultiHeadAttention::forward`], as burn-nn's `MhaOutput`.
#[derive(Debug, Clone)]
pub struct MhaOutput {
    /// The attention weights `[batch, heads, seq, keys]`.
    pub weights: Tensor<4>,
    /// The context `[batch, seq, d_model]`.
    pub context: Tensor<3>,
}

impl MultiHeadAttentionConfig {
    /// Initialises the module (burn-nn's initialisation).
    pub fn init(&self, device: &Device) -> MultiHeadAttention {
        let linear = |bias: bool| {
            LinearConfig::new(self.d_model, self.d_model)
                .with_initializer(self.initializer.clone())
                .with_bias(bias)
                .init(device)
        };
        MultiHeadAttention {
            query: linear(self.query_bias),
            key: linear(self.key_bias),
            value: linear(self.value_bias),
            output: linear(self.output_bias),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: Gelu::new(),
            d_model: self.d_model,
            n_heads: self.n_heads,
            d_k: self.d_model / self.n_heads,
            min_float: self.min_float,
            quiet_softmax: self.quiet_softmax,
            fused: self.fused,
        }
    }
}

impl MultiHeadAttention {
    /// Attends, as burn-nn's `forward`.
    ///
    /// # Panics
    /// When the inputs' widths are not `d_model` or their batches or key lengths differ (as
    /// burn-nn's).
    pub fn forward(&self, input: MhaInput) -> MhaOutput {
        let [batch, seq, d_model] = input.query.dims();
        let [key_batch, keys, key_width] = input.key.dims();
        let value_dims = input.value.dims();
        assert!(
            d_model == self.d_model
                && key_width == self.d_model
                && key_batch == batch
                && value_dims == [batch, keys, self.d_model],
            "MultiHeadAttention (d_model {}): query {:?}, key {:?}, value {:?} do not fit",
            self.d_model,
            [batch, seq, d_model],
            [key_batch, keys, key_width],
            value_dims
        );
        let (query, key, value) = if input.self_attention && self.fused {
            self.project_together(input.query)
        } else {
            (
                self.heads(self.project(&self.query, input.query)),
                self.heads(self.project(&self.key, input.key)),
                self.heads(self.project(&self.value, input.value)),
            )
        };
        let weights = attention_weights(
            query.matmul(key.transpose()),
            self.softmax_of(),
            input.mask_pad,
            input.mask_attn,
        );
        let weights = self.dropout.forward(weights);
        let context =
            weights
                .clone()
                .matmul(value)
                .swap_dims(1, 2)
                .reshape([batch, seq, self.d_model]);
        MhaOutput {
            weights,
            context: self.project(&self.output, context),
        }
    }

    /// `x` through one of the four projections: [`super::linear`] when fused, else burn-nn's.
    fn project(&self, layer: &Linear, x: Tensor<3>) -> Tensor<3> {
        super::functional::linear_layer(layer, x, self.fused)
    }

    /// `[batch, seq, d_model]` as `[batch, heads, seq, d_k]`.
    fn heads(&self, x: Tensor<3>) -> Tensor<4> {
        let [batch, seq, _] = x.dims();
        x.reshape([batch, seq, self.n_heads, self.d_k])
            .swap_dims(1, 2)
    }

    /// The context alone, `[batch, seq, d_model]`: what `forward(input).context` is. On Flex,
    /// for self-attention without dropout, one fused operation from the QKV product to the
    /// context that never holds the `[batch, heads, seq, seq]` weights (flash-style: the
    /// backward pass recomputes them tile by tile), so a training step keeps less; elsewhere
    /// it is [`MultiHeadAttention::forward`]'s context.
    ///
    /// # Panics
    /// As [`MultiHeadAttention::forward`].
    pub fn forward_context(&self, input: MhaInput) -> Tensor<3> {
        #[cfg(feature = "flex")]
        if self.fused
            && input.self_attention
            && self.dropout.prob == 0.0
            && super::fused_here(&input.query)
            && input.query.dims()[2] == self.d_model
        {
            let [batch, seq, _] = input.query.dims();
            let mask =
                super::functional::one_mask(input.mask_pad, input.mask_attn, [batch, seq, seq]);
            let scale = 1.0 / self.softmax_of().divisor;
            let (heads, fill, quiet) = (self.n_heads, self.min_float, self.quiet_softmax);
            // In the QKV product's type (bf16 and f16 computed in f32 inside, kept as they are).
            let qkv = self.project_qkv(input.query);
            let context = crate::cpu_kernels::self_attention(qkv, mask, heads, scale, fill, quiet);
            return self.project(&self.output, context);
        }
        self.forward(input).context
    }

    /// How the scores become weights: burn-nn's division by `sqrt(d_k)` (in f32, as there),
    /// fill value and softmax.
    fn softmax_of(&self) -> AttentionSoftmax {
        AttentionSoftmax {
            divisor: f64::from((self.d_k as f32).sqrt()),
            fill: self.min_float,
            quiet: self.quiet_softmax,
            fused: self.fused,
        }
    }

    /// Query, key and value of one input `[batch, seq, d_model]` through one `[d_model, 3
    /// d_model]` product (one larger GEMM instead of three; the weights' concatenation is
    /// differentiable, so each projection gets its own gradient): `[batch, seq, 3 d_model]`,
    /// query, key and value side by side.
    fn project_qkv(&self, x: Tensor<3>) -> Tensor<3> {
        let [batch, seq, _] = x.dims();
        let linears = [&self.query, &self.key, &self.value];
        let [wq, wk, wv] = linears.map(|l| l.weight.val());
        // Ours keeps no copy of the three weights until backward (Burn's cat does).
        #[cfg(feature = "flex")]
        let weight = if super::all_f32_on_flex(&x, &[&wq, &wk, &wv], None) {
            crate::cpu_kernels::weight_cat(wq, wk, wv)
        } else {
            Tensor::cat(vec![wq, wk, wv], 1)
        };
        #[cfg(not(feature = "flex"))]
        let weight = Tensor::cat(vec![wq, wk, wv], 1);
        let device = x.device();
        let biases = linears
            .iter()
            .map(|l| {
                l.bias
                    .as_ref()
                    .map_or_else(|| Tensor::zeros([self.d_model], &device), |b| b.val())
            })
            .collect();
        let d = self.d_model;
        // One 2-d product over all tokens, as Linear computes it.
        super::linear(
            x.reshape([batch * seq, d]),
            weight,
            Some(Tensor::cat(biases, 0)),
        )
        .reshape([batch, seq, 3 * d])
    }

    /// [`MultiHeadAttention::project_qkv`] split into heads, each `[batch, heads, seq, d_k]`.
    fn project_together(&self, x: Tensor<3>) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        let [batch, seq, _] = x.dims();
        let d = self.d_model;
        let projected = self.project_qkv(x);
        let part = |i: usize| {
            self.heads(
                projected
                    .clone()
                    .slice([0..batch, 0..seq, i * d..(i + 1) * d]),
            )
        };
        (part(0), part(1), part(2))
    }
}
