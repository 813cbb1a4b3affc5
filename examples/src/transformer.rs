//! A decoder-only transformer language model: learned token and position embeddings,
//! pre-LayerNorm transformer layers under a causal mask, a final LayerNorm, and an output
//! layer tied to the token embedding (logits are hidden states times its transpose).
//!
//! The layers, norms and loss are `accelerate_burn::nn`'s (burn-nn's modules, records and
//! results, with our fused kernels on the CPU: linear layers, layer norm, attention, GELU,
//! cross-entropy); `fused: false` computes all of them as burn-nn and Burn do, for comparisons.

use accelerate_burn::nn::{
    LayerNorm, LayerNormConfig, TransformerEncoder, TransformerEncoderConfig,
    TransformerEncoderInput, TransformerEncoderLayer, cross_entropy, linear,
};
use accelerate_burn::{
    AccelerateError, Accelerator, AcceleratorBackend, Sharded, Unit, WholeUnit, burn,
};
use burn::config::Config;
use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::{Embedding, EmbeddingConfig, Initializer};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor};

/// Shape of a [`TransformerLm`].
#[derive(Config, Debug)]
pub struct TransformerLmConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// Longest sequence (learned positions).
    pub context: usize,
    /// Transformer layers.
    pub layers: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads per layer.
    pub heads: usize,
    /// Hidden width of each layer's MLP (GELU).
    pub mlp: usize,
    /// Our fused kernels on the CPU (`false`: burn-nn's and Burn's computation). Default: true
    #[config(default = true)]
    pub fused: bool,
}

/// The model: see the module documentation. `L` is a layer unit: the layer itself, or a
/// [`Sharded`] one ([`shard_layers`](TransformerLm::shard_layers), ZeRO-3); embeddings and
/// the final norm stay whole.
#[derive(Module, Debug)]
pub struct TransformerLm<L: Module = TransformerEncoderLayer> {
    tokens: Embedding,
    positions: Embedding,
    layers: TransformerEncoder<L>,
    norm: LayerNorm,
    /// Whether the loss is our fused cross-entropy (not part of the record).
    fused: bool,
}

impl TransformerLmConfig {
    /// Builds the model on `device`: embeddings drawn from N(0, 0.02) (the tied output layer
    /// then starts near uniform), Burn's default initialisation elsewhere, no dropout.
    pub fn init(&self, device: &Device) -> TransformerLm {
        let small = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        TransformerLm {
            tokens: EmbeddingConfig::new(self.vocab, self.d_model)
                .with_initializer(small.clone())
                .init(device),
            positions: EmbeddingConfig::new(self.context, self.d_model)
                .with_initializer(small)
                .init(device),
            layers: TransformerEncoderConfig::new(self.d_model, self.mlp, self.heads, self.layers)
                .with_dropout(0.0)
                .with_norm_first(true)
                .with_fused(self.fused)
                .init(device),
            norm: LayerNormConfig::new(self.d_model)
                .with_fused(self.fused)
                .init(device),
            fused: self.fused,
        }
    }

    /// Parameters of a model of this shape.
    pub fn parameters(&self) -> usize {
        let (d, m) = (self.d_model, self.mlp);
        let per_layer = 4 * (d * d + d) + (d * m + m) + (m * d + d) + 4 * d;
        (self.vocab + self.context) * d + self.layers * per_layer + 2 * d
    }
}

impl TransformerLm {
    /// The model with each transformer layer sharded over the processes by `acc` (ZeRO-3,
    /// `zero_stage(3)`): one layer whole at a time in the forward and backward passes.
    pub fn shard_layers<B: AcceleratorBackend>(
        self,
        acc: &Accelerator<B>,
    ) -> Result<TransformerLm<Sharded<TransformerEncoderLayer>>, AccelerateError> {
        self.layers_as_units(|layer| acc.shard(layer))
    }

    /// The model with each transformer layer a unit kept whole (`acc.unit`, ZeRO 0 to 2):
    /// with several processes, each layer's gradients are averaged while backward goes on
    /// through the layers before it.
    pub fn unit_layers<B: AcceleratorBackend>(
        self,
        acc: &Accelerator<B>,
    ) -> Result<TransformerLm<WholeUnit<TransformerEncoderLayer>>, AccelerateError> {
        self.layers_as_units(|layer| acc.unit(layer))
    }

    /// The model with each layer made a unit by `unit`, which may draw the layer's weights.
    fn layers_as_units<L: Module>(
        self,
        unit: impl FnMut(TransformerEncoderLayer) -> Result<L, AccelerateError>,
    ) -> Result<TransformerLm<L>, AccelerateError> {
        // Burn draws lazily initialised weights when they are first used; drawing the
        // embeddings' before the layers' (visit order, as `prepare` draws a plain model's)
        // makes a model of units start from the same weights as the plain one.
        let _drawn = (self.tokens.weight.val(), self.positions.weight.val());
        self.map_layers(unit)
    }
}

impl<L: Module> TransformerLm<L> {
    /// The same model with each layer made another unit by `f`.
    pub fn map_layers<L2: Module, E>(
        self,
        f: impl FnMut(L) -> Result<L2, E>,
    ) -> Result<TransformerLm<L2>, E> {
        Ok(TransformerLm {
            tokens: self.tokens,
            positions: self.positions,
            layers: self.layers.map_layers(f)?,
            norm: self.norm,
            fused: self.fused,
        })
    }
}

impl<L: Unit<TransformerEncoderLayer>> TransformerLm<L> {
    /// The model with every layer whole (each gathered, when sharded: a collective).
    pub fn whole(&self) -> TransformerLm {
        let whole = self
            .clone()
            .map_layers(|layer| Ok::<_, std::convert::Infallible>(layer.whole()));
        match whole {
            Ok(model) => model,
            Err(never) => match never {},
        }
    }

    /// Logits `[batch, seq, vocab]` for the tokens `[batch, seq]` (seq at most the context).
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(0..seq as i64, &device).reshape([1, seq]);
        let [vocab, d_model] = self.tokens.weight.val().dims();
        let x = self.tokens.forward(tokens)
            + self
                .positions
                .forward(positions)
                .expand([batch, seq, d_model]);
        let mask = generate_autoregressive_mask(batch, seq, &device);
        let x = self
            .layers
            .forward(TransformerEncoderInput::new(x).mask_attn(mask));
        let x = self.norm.forward(x).reshape([batch * seq, d_model]);
        // The output layer is the token embedding, transposed (tied weights).
        let tied = self.tokens.weight.val().transpose();
        let logits = if self.fused {
            linear(x, tied, None)
        } else {
            x.matmul(tied)
        };
        logits.reshape([batch, seq, vocab])
    }

    /// Each sequence's cross-entropy summed over its tokens, `[batch]` (in nats), against
    /// `targets` `[batch, seq]`.
    pub fn sequence_losses(&self, tokens: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        let [batch, seq] = targets.dims();
        let logits = self.forward(tokens);
        if self.fused {
            let [.., vocab] = logits.dims();
            let losses = cross_entropy(
                logits.reshape([batch * seq, vocab]),
                targets.reshape([batch * seq]),
            );
            return losses.reshape([batch, seq]).sum_dim(1).reshape([batch]);
        }
        let log_probs = log_softmax(logits, 2);
        let picked = log_probs.gather(2, targets.reshape([batch, seq, 1]));
        picked.sum_dim(1).reshape([batch]).neg()
    }
}
