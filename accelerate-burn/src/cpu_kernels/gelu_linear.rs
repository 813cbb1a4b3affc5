//! The fused GELU and linear layer, `linear(gelu(x), weight, bias)`: the second half of a
//! transformer's feed-forward network as one operation whose backward node keeps only `x`.
//!
//! Apart, the GELU keeps its input and the linear layer keeps the GELU's output, two tensors of
//! the network's widest shape (`[tokens, d_ff]`) per layer until the backward pass. Here the
//! GELU's output is a temporary of the forward pass, recomputed in the backward pass in the same
//! element-wise pass that differentiates it. The products are the fused linear layer's
//! ([`super::linear`]): the `gemm` crate's, as Burn's, without Burn's zero-fill and copy around
//! each.

use burn::backend::Flex;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;

use super::{gelu, linear};

/// `linear(gelu(x), weight, bias)` on Flex tensors.
pub(super) fn forward(x: &FlexTensor, weight: &FlexTensor, bias: &FlexTensor) -> FlexTensor {
    linear::forward(&gelu::forward(x), weight, Some(bias))
}

/// The backward node (parents: x, weight, bias).
#[derive(Debug)]
struct GeluLinearBackward;

impl Backward<Flex, 3> for GeluLinearBackward {
    /// The checkpoints of `x` and of the weight.
    type State = (NodeId, NodeId);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_weight, node_bias] = ops.parents;
        let (x_state, weight_state) = ops.state;
        let x: FlexTensor = checkpointer.retrieve_node_output(x_state);
        let weight: FlexTensor = checkpointer.retrieve_node_output(weight_state);
        let dy: FlexTensor = grads.consume::<Flex>(&ops.node);
        // dy W^T first: then the GELU and its derivative come out of one pass over x.
        let dactivation = linear::input_grad(&dy, &weight);
        let (activation, dx) = gelu::recompute_backward(&x, dactivation);
        if let Some(node) = node_weight {
            grads.register::<Flex>(node.id, linear::weight_grad(&activation, &dy));
        }
        if let Some(node) = node_bias {
            grads.register::<Flex>(node.id, linear::bias_grad(&dy));
        }
        if let Some(node) = node_x {
            grads.register::<Flex>(node.id, dx);
        }
    }
}

/// The fused GELU and linear layer under autodiff.
pub(super) fn tracked<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
    weight: FloatTensor<Autodiff<Flex, C>>,
    bias: FloatTensor<Autodiff<Flex, C>>,
) -> FloatTensor<Autodiff<Flex, C>> {
    let y = forward(x.primitive(), weight.primitive(), bias.primitive());
    // Compute-bound for checkpointing (it holds a matrix product): its output is kept when a
    // later recomputation needs it, never recomputed.
    match GeluLinearBackward
        .prepare::<C>([x.node(), weight.node(), bias.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let state = (prep.checkpoint(&x), prep.checkpoint(&weight));
            prep.finish(state, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}
