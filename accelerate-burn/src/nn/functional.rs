//! Free functions for hand-built models: [`linear`], [`gelu`], [`attention`], [`cross_entropy`]
//! (and [`layer_norm`](super::layer_norm)). Each runs our fused kernel on Flex (f32, and f16/bf16
//! computed in f32; [`linear`] f32, and bf16/f16 with half-precision products accumulated in
//! f32) and Burn's own operations everywhere else, with the same results.

use burn::tensor::activation::{log_softmax, quiet_softmax, softmax};
use burn::tensor::{Bool, Int, Tensor};

#[cfg(feature = "flex")]
use super::{fused_here, in_f32};

/// `x weight + bias` over the last dimension of `x` (`[..., d_in]`, `weight` `[d_in, d_out]`),
/// as `burn::tensor::module::linear` and burn-nn's `Linear`. On Flex with f32 values, our
/// product with the bias in the same call and our backward (the `gemm` crate's products, as
/// Burn's, without Burn's zero-fill and alignment copy of each output on the calling thread,
/// and with a parallel bias gradient); a transposed `weight` (a tied embedding's
/// `weight.transpose()`) is read in place. Elsewhere, Burn's `linear`.
///
/// # Panics
/// When the last dimension of `x` is not `d_in`, or the bias is not `d_out` wide.
pub fn linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    let [d_in, d_out] = weight.dims();
    let last = x.dims()[D - 1];
    assert_eq!(
        last, d_in,
        "linear: input of width {last} for a weight of {d_in} x {d_out}"
    );
    if let Some(bias) = &bias {
        let [width] = bias.dims();
        assert_eq!(
            width, d_out,
            "linear: a bias of {width} for {d_out} outputs"
        );
    }
    #[cfg(feature = "flex")]
    if super::all_f32_on_flex(&x, &[&weight], bias.as_ref())
        || super::all_half_on_flex(&x, &[&weight], bias.as_ref())
    {
        return crate::cpu_kernels::linear(x, weight, bias);
    }
    burn::tensor::module::linear(x, weight, bias)
}

/// burn-nn's `layer` applied to `x` through [`linear`] when `fused`, else as burn-nn applies it.
pub(super) fn linear_layer<const D: usize>(
    layer: &burn::nn::Linear,
    x: Tensor<D>,
    fused: bool,
) -> Tensor<D> {
    if fused {
        linear(
            x,
            layer.weight.val(),
            layer.bias.as_ref().map(|bias| bias.val()),
        )
    } else {
        layer.forward(x)
    }
}

/// The exact GELU, `x * Φ(x)`, as `burn::tensor::activation::gelu`, with the exact derivative
/// `Φ(x) + x φ(x)` as its gradient. On Flex, bf16 and f16 are read and written as they are and
/// computed in f32.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "flex")]
    if fused_here(&x) {
        return crate::cpu_kernels::gelu(x);
    }
    burn::tensor::activation::gelu(x)
}

/// Each row's softmax cross-entropy, `[rows]` in nats, of `logits` `[rows, classes]` against
/// the class indices `targets` `[rows]`: `-log_softmax(logits)[row, target]`. Sum or average
/// it for a loss (`.mean()` is burn-nn's `CrossEntropyLoss` without weights or smoothing).
///
/// # Panics
/// When `targets` does not have one class per row, or (on Flex) a target is not in
/// `0..classes` (Burn's gather panics there too).
pub fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let [rows, _] = logits.dims();
    let [n] = targets.dims();
    assert_eq!(
        n, rows,
        "cross_entropy: {n} targets for {rows} rows of logits"
    );
    #[cfg(feature = "flex")]
    if fused_here(&logits) {
        return in_f32(logits, |logits| {
            crate::cpu_kernels::cross_entropy(logits, targets)
        });
    }
    log_softmax(logits, 1)
        .gather(1, targets.reshape([rows, 1]))
        .reshape([rows])
        .neg()
}

/// Scaled dot-product attention, `softmax(q k^T / sqrt(d_k), masked) v`, over `[batch, heads,
/// seq, d_k]` queries and `[batch, heads, keys, d_k]` keys and values, as burn-nn's
/// `MultiHeadAttention` computes it: `scale` is `1 / sqrt(d_k)`, and masked scores (`mask`
/// `[batch, seq, keys]`, true: masked) become -1e4 before the softmax. Returns the context
/// `[batch, heads, seq, d_k]`.
pub fn attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: Option<Tensor<3, Bool>>,
) -> Tensor<4> {
    let [.., d_k] = query.dims();
    let weights = attention_weights(
        query.matmul(key.transpose()),
        AttentionSoftmax {
            divisor: f64::from((d_k as f32).sqrt()),
            fill: -1.0e4,
            quiet: false,
            fused: true,
        },
        None,
        mask,
    );
    weights.matmul(value)
}

/// How attention turns scores into weights.
#[derive(Debug, Clone, Copy)]
pub(super) struct AttentionSoftmax {
    /// What the raw scores `q k^T` are divided by (`sqrt(d_k)`, computed in f32 as burn-nn
    /// computes it).
    pub divisor: f64,
    /// The value of a masked score.
    pub fill: f64,
    /// Quiet softmax (a row may attend to nothing).
    pub quiet: bool,
    /// Our fused kernel where it runs (only a flex build has it).
    #[cfg_attr(not(feature = "flex"), allow(dead_code))]
    pub fused: bool,
}

/// The attention weights of the raw scores `[batch, heads, seq, keys]`, masked by a padding
/// mask `[batch, keys]` and an attention mask `[batch, seq, keys]` (true: masked).
pub(super) fn attention_weights(
    scores: Tensor<4>,
    softmax_of: AttentionSoftmax,
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<Tensor<3, Bool>>,
) -> Tensor<4> {
    let [batch, _, seq, keys] = scores.dims();
    #[cfg(feature = "flex")]
    if softmax_of.fused && fused_here(&scores) {
        let mask = one_mask(mask_pad, mask_attn, [batch, seq, keys]);
        return in_f32(scores, |scores| {
            crate::cpu_kernels::attention_softmax(
                scores,
                mask,
                1.0 / softmax_of.divisor,
                softmax_of.fill,
                softmax_of.quiet,
            )
        });
    }
    // burn-nn's order: divide by sqrt(d_k), fill each mask, softmax.
    let mut scores = scores.div_scalar(softmax_of.divisor);
    if let Some(mask) = mask_pad {
        scores = scores.mask_fill(mask.reshape([batch, 1, 1, keys]), softmax_of.fill);
    }
    if let Some(mask) = mask_attn {
        scores = scores.mask_fill(mask.reshape([batch, 1, seq, keys]), softmax_of.fill);
    }
    if softmax_of.quiet {
        quiet_softmax(scores, 3)
    } else {
        softmax(scores, 3)
    }
}

/// A padding mask `[batch, keys]` and an attention mask `[batch, seq, keys]` (true: masked) as
/// one `[batch, seq, keys]` mask, the form our fused kernels take.
#[cfg(feature = "flex")]
pub(super) fn one_mask(
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<Tensor<3, Bool>>,
    [batch, seq, keys]: [usize; 3],
) -> Option<Tensor<3, Bool>> {
    let pad = mask_pad.map(|m| m.reshape([batch, 1, keys]).expand([batch, seq, keys]));
    match (pad, mask_attn) {
        (Some(pad), Some(attn)) => Some(pad.bool_or(attn)),
        (pad, attn) => pad.or(attn),
    }
}
