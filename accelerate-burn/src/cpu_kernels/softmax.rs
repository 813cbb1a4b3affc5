//! The fused attention softmax: [`accelerate_kernels::softmax`] on Flex tensors, scaled and
//! optionally masked, and its backward node (state: the probabilities and the mask).

use accelerate_kernels::softmax::{self, Mask, Softmax};
use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;

use super::{contiguous, flex_tensor, row_shape, values};

/// What the softmax computes besides its input.
#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    scale: f32,
    fill: f32,
    quiet: bool,
}

impl Settings {
    /// The scale applied to the scores, the masked scores' value, and quiet softmax or not.
    pub(super) fn new(scale: f64, fill: f64, quiet: bool) -> Self {
        Self {
            scale: scale as f32,
            fill: fill as f32,
            quiet,
        }
    }
}

/// The mask's bytes, row-major (Flex keeps a bool as one byte).
pub(super) fn mask_bytes(mask: &FlexTensor) -> Vec<u8> {
    let mask = contiguous(mask);
    let bytes = mask.storage::<u8>();
    match mask.layout().contiguous_offsets() {
        Some((start, end)) => bytes.get(start..end).unwrap_or(&[]).to_vec(),
        None => Vec::new(),
    }
}

/// The kernel's description of one call on scores of `dims` `[batch, heads, seq, keys]`.
fn describe<'a>(dims: &[usize], mask: Option<&'a [u8]>, settings: Settings) -> Softmax<'a> {
    let (heads, seq) = match dims {
        [.., heads, seq, _] => (*heads, *seq),
        _ => (1, 1),
    };
    Softmax {
        scale: settings.scale,
        quiet: settings.quiet,
        mask: mask.map(|masked| Mask {
            masked,
            heads,
            seq,
            fill: settings.fill,
        }),
    }
}

/// The probabilities of `scores`, masked where `mask` (its [`mask_bytes`]) is nonzero (see
/// `CpuKernels`).
pub(super) fn forward(scores: &FlexTensor, mask: Option<&[u8]>, settings: Settings) -> FlexTensor {
    let shape = scores.shape();
    let softmax = describe(shape.as_slice(), mask, settings);
    let scores = contiguous(scores);
    let mut probs = vec![0.0; shape.num_elements()];
    softmax::forward(row_shape(&shape), &softmax, values(&scores), &mut probs);
    flex_tensor(probs, shape)
}

/// The backward node of the fused softmax.
#[derive(Debug)]
struct SoftmaxBackward;

impl Backward<Flex, 1> for SoftmaxBackward {
    /// The probabilities, the mask's bytes, and the settings.
    type State = (FlexTensor, Option<Vec<u8>>, Settings);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_scores] = ops.parents;
        let dprobs: FlexTensor = grads.consume::<Flex>(&ops.node);
        let Some(node) = node_scores else { return };
        let (probs, mask, settings) = ops.state;
        let shape = probs.shape();
        let softmax = describe(shape.as_slice(), mask.as_deref(), settings);
        let dprobs = contiguous(&dprobs);
        let mut dscores = vec![0.0; shape.num_elements()];
        softmax::backward(
            row_shape(&shape),
            &softmax,
            values(&probs),
            values(&dprobs),
            &mut dscores,
        );
        grads.register::<Flex>(node.id, flex_tensor(dscores, shape));
    }
}

/// The fused softmax under autodiff (the mask is not differentiable).
pub(super) fn tracked<C: CheckpointStrategy>(
    scores: FloatTensor<Autodiff<Flex, C>>,
    mask: Option<FlexTensor>,
    settings: Settings,
) -> FloatTensor<Autodiff<Flex, C>> {
    let bytes = mask.as_ref().map(mask_bytes);
    let probs = forward(scores.primitive(), bytes.as_deref(), settings);
    match SoftmaxBackward
        .prepare::<C>([scores.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((probs.clone(), bytes, settings), probs),
        OpsKind::UnTracked(prep) => prep.finish(probs),
    }
}
