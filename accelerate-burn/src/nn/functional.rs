//! Free functions for hand-built models: [`gelu`], [`attention`], [`cross_entropy`] (and
//! [`layer_norm`](super::layer_norm)). Each runs our fused kernel on Flex (f32, and f16/bf16
//! computed in f32) and Burn's own operations everywhere else, with the same results.

use burn::tensor::activation::{log_softmax, quiet_softmax, softmax};
use burn::tensor::{Bool, Int, Tensor};

#[cfg(feature = "flex")]
use super::{fused_here, in_f32};

/// The exact GELU, `x * Φ(x)`, as `burn::tensor::activation::gelu`, with the exact derivative
/// `Φ(x) + x φ(x)` as its gradient.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "flex")]
    if fused_here(&x) {
        return in_f32(x, crate::cpu_kernels::gelu);
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
