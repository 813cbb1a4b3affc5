//! Fused self-attention: [`accelerate_kernels::attention`] on Flex tensors, from the one QKV
//! product `[batch, seq, 3 * d_model]` to the context `[batch, seq, d_model]`, and its backward
//! node (state: the QKV tensor, two numbers per query row, the mask). The `[batch, heads, seq,
//! seq]` weights are never kept: the backward pass recomputes them tile by tile. A bf16 or f16
//! QKV tensor (autocast) is computed in f32 between parallel casts and kept in its own type.

use accelerate_kernels::attention::{self, Mask, SelfAttention};
use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, FloatDType};

use super::softmax::mask_bytes;
use super::{cast, contiguous, flex_tensor, values};

/// What the attention computes besides its input.
#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    heads: usize,
    scale: f32,
    fill: f32,
    quiet: bool,
}

impl Settings {
    /// The number of heads, the scores' scale, the masked scores' value, quiet softmax or not.
    pub(super) fn new(heads: usize, scale: f64, fill: f64, quiet: bool) -> Self {
        Self {
            heads,
            scale: scale as f32,
            fill: fill as f32,
            quiet,
        }
    }

    /// The kernel's description of a call on `qkv` of `dims` `[batch, seq, 3 * d_model]`.
    fn describe<'a>(&self, dims: &[usize], mask: Option<&'a [u8]>) -> SelfAttention<'a> {
        let (batch, seq, width) = match dims {
            [batch, seq, width] => (*batch, *seq, *width),
            _ => (0, 0, 0),
        };
        SelfAttention {
            batch,
            seq,
            heads: self.heads,
            head_dim: (width / 3).checked_div(self.heads).unwrap_or(0),
            scale: self.scale,
            quiet: self.quiet,
            mask: mask.map(|masked| Mask {
                masked,
                fill: self.fill,
            }),
        }
    }
}

/// The context `[batch, seq, d_model]` (of `qkv`'s type) and the rows' statistics of the
/// attention over `qkv`.
pub(super) fn forward(
    qkv: &FlexTensor,
    mask: Option<&[u8]>,
    settings: Settings,
) -> (FlexTensor, Vec<f32>) {
    let dtype = qkv.dtype();
    if dtype != DType::F32 {
        let (context, stats) = forward(&cast::widened(qkv), mask, settings);
        return (cast::forward(&context, FloatDType::from(dtype)), stats);
    }
    let shape = qkv.shape();
    let dims = shape.as_slice();
    let call = settings.describe(dims, mask);
    let qkv = contiguous(qkv);
    let (context, stats) = attention::forward(&call, values(&qkv));
    let out: burn::tensor::Shape = [call.batch, call.seq, call.heads * call.head_dim].into();
    (flex_tensor(context, out), stats)
}

/// The backward node of the fused self-attention.
#[derive(Debug)]
struct SelfAttentionBackward;

impl Backward<Flex, 1> for SelfAttentionBackward {
    /// The QKV tensor, the rows' statistics, the mask's bytes and the settings.
    type State = (FlexTensor, Vec<f32>, Option<Vec<u8>>, Settings);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_qkv] = ops.parents;
        let dcontext: FlexTensor = grads.consume::<Flex>(&ops.node);
        let Some(node) = node_qkv else { return };
        let (qkv, stats, mask, settings) = ops.state;
        let shape = qkv.shape();
        let call = settings.describe(shape.as_slice(), mask.as_deref());
        // The gradient of the QKV tensor's type; half precision computed in f32.
        let dtype = FloatDType::from(qkv.dtype());
        let in_f32 = |t: &FlexTensor| contiguous(&cast::widened(t));
        let (qkv, dcontext) = (in_f32(&qkv), in_f32(&dcontext));
        let dqkv = attention::backward(&call, values(&qkv), &stats, values(&dcontext));
        let dqkv = cast::forward(&flex_tensor(dqkv, shape), dtype);
        grads.register::<Flex>(node.id, dqkv);
    }
}

/// The mask's bytes for the kernel: one `[seq, seq]` plane when every sequence shares it (a
/// mask expanded over the batch, as burn-nn's causal mask is: a batch stride of 0), else
/// [`mask_bytes`]' copy of the whole `[batch, seq, seq]`.
pub(super) fn attention_mask_bytes(mask: &FlexTensor) -> Vec<u8> {
    let layout = mask.layout();
    if let ([_, rows, cols], [0, row_stride, 1]) = (layout.shape().as_slice(), layout.strides())
        && usize::try_from(*row_stride).ok() == Some(*cols)
    {
        let start = layout.start_offset();
        let plane = mask.storage::<u8>().get(start..start + rows * cols);
        if let Some(plane) = plane {
            return plane.to_vec();
        }
    }
    mask_bytes(mask)
}

/// The fused self-attention under autodiff (the mask is not differentiable).
pub(super) fn tracked<C: CheckpointStrategy>(
    qkv: FloatTensor<Autodiff<Flex, C>>,
    mask: Option<FlexTensor>,
    settings: Settings,
) -> FloatTensor<Autodiff<Flex, C>> {
    let bytes = mask.as_ref().map(attention_mask_bytes);
    let (context, stats) = forward(qkv.primitive(), bytes.as_deref(), settings);
    // Compute-bound for checkpointing: the statistics are kept, never recomputed.
    match SelfAttentionBackward
        .prepare::<C>([qkv.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = (qkv.primitive().clone(), stats, bytes, settings);
            prep.finish(state, context)
        }
        OpsKind::UnTracked(prep) => prep.finish(context),
    }
}
