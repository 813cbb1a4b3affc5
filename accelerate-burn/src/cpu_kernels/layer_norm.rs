//! The fused layer norm: [`accelerate_kernels::layer_norm`] on Flex tensors, and its backward
//! node (parents `x`, `gamma`, `beta`; state: the input, gamma and each row's statistics).
//! bf16 and f16 tensors (autocast) are computed in f32 between parallel casts, and kept for the
//! backward pass in their own type (half the bytes of an f32 copy).

use accelerate_kernels::layer_norm;
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

use super::{cast, contiguous, flex_tensor, owned_contiguous, row_shape, values};

/// The forward pass: the output (of `x`'s type), and each row's mean and reciprocal standard
/// deviation (f32).
pub(super) fn forward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: &FlexTensor,
    epsilon: f64,
) -> (FlexTensor, FlexTensor) {
    let dtype = x.dtype();
    if dtype != DType::F32 {
        let (y, stats) = forward(
            &cast::widened(x),
            &cast::widened(gamma),
            &cast::widened(beta),
            epsilon,
        );
        return (cast::forward(&y, FloatDType::from(dtype)), stats);
    }
    let shape = x.shape();
    let rows = row_shape(&shape);
    let (x, gamma, beta) = (contiguous(x), contiguous(gamma), contiguous(beta));
    let (y, stats) = layer_norm::forward(
        rows,
        values(&x),
        values(&gamma),
        Some(values(&beta)),
        epsilon as f32,
    );
    let stats_len = stats.len();
    (
        flex_tensor(y, shape),
        flex_tensor(stats, [stats_len].into()),
    )
}

/// The backward node of the fused layer norm.
#[derive(Debug)]
struct LayerNormBackward;

impl Backward<Flex, 3> for LayerNormBackward {
    /// The forward input, gamma, and the rows' statistics.
    type State = (FlexTensor, FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_gamma, node_beta] = ops.parents;
        let dy: FlexTensor = grads.consume::<Flex>(&ops.node);
        let (x, gamma, stats) = ops.state;
        // Gradients of the input's type; a half-precision input is computed in f32.
        let dtype = FloatDType::from(x.dtype());
        let (x, gamma, dy) = (cast::widened(&x), cast::widened(&gamma), cast::widened(&dy));
        let typed = |t: FlexTensor| cast::forward(&t, dtype);
        let shape = x.shape();
        let rows = row_shape(&shape);
        let (x, gamma) = (contiguous(&x), contiguous(&gamma));
        // dy's storage becomes dx (copied first only where another tensor shares it).
        let mut dx = owned_contiguous(dy);
        let mut dgamma = vec![0.0; rows.width];
        let mut dbeta = vec![0.0; rows.width];
        layer_norm::backward(
            rows,
            values(&x),
            values(&gamma),
            values(&stats),
            dx.storage_mut::<f32>(),
            &mut dgamma,
            &mut dbeta,
        );
        let width: burn::tensor::Shape = [rows.width].into();
        if let Some(node) = node_x {
            grads.register::<Flex>(node.id, typed(dx));
        }
        if let Some(node) = node_gamma {
            grads.register::<Flex>(node.id, typed(flex_tensor(dgamma, width.clone())));
        }
        if let Some(node) = node_beta {
            grads.register::<Flex>(node.id, typed(flex_tensor(dbeta, width)));
        }
    }
}

/// The fused layer norm under autodiff.
pub(super) fn tracked<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
    gamma: FloatTensor<Autodiff<Flex, C>>,
    beta: FloatTensor<Autodiff<Flex, C>>,
    epsilon: f64,
) -> FloatTensor<Autodiff<Flex, C>> {
    // Compute-bound for checkpointing: the statistics are kept, never recomputed.
    match LayerNormBackward
        .prepare::<C>([x.node(), gamma.node(), beta.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (y, stats) = forward(x.primitive(), gamma.primitive(), beta.primitive(), epsilon);
            let state = (x.primitive().clone(), gamma.primitive().clone(), stats);
            prep.finish(state, y)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(forward(x.primitive(), gamma.primitive(), beta.primitive(), epsilon).0)
        }
    }
}
