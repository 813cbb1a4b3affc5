//! The fused layer norm: [`accelerate_kernels::layer_norm`] on Flex tensors, and its backward
//! node (parents `x`, `gamma`, `beta`; state: the input, gamma and each row's statistics).

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

use super::{contiguous, flex_tensor, owned_contiguous, row_shape, values};

/// The forward pass: the output, and each row's mean and reciprocal standard deviation.
pub(super) fn forward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: &FlexTensor,
    epsilon: f64,
) -> (FlexTensor, FlexTensor) {
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
            grads.register::<Flex>(node.id, dx);
        }
        if let Some(node) = node_gamma {
            grads.register::<Flex>(node.id, flex_tensor(dgamma, width.clone()));
        }
        if let Some(node) = node_beta {
            grads.register::<Flex>(node.id, flex_tensor(dbeta, width));
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
