//! The fused GELU: [`accelerate_kernels::gelu`] on Flex tensors, and its backward node (state:
//! the input, by checkpoint). Its gradient is the exact derivative `Φ(x) + x φ(x)`. Memory-bound
//! with a retro-forward, as Burn's own GELU: under gradient checkpointing its output is
//! recomputed in the backward pass, not kept. bf16 and f16 tensors (autocast) are read and
//! written in their own type and computed in f32 chunk by chunk: no f32 copy is cast or kept.

use accelerate_kernels::gelu;
use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, bf16, f16};

use super::{contiguous, flex_tensor, half_tensor, half_values, owned_contiguous, values};

/// `x * Φ(x)` of a Flex tensor (f32; bf16 and f16 computed in f32, rounded once).
pub(super) fn forward(x: &FlexTensor) -> FlexTensor {
    let shape = x.shape();
    let x = contiguous(x);
    match x.dtype() {
        DType::BF16 => half_tensor(gelu::forward_half(half_values::<bf16>(&x)), shape),
        DType::F16 => half_tensor(gelu::forward_half(half_values::<f16>(&x)), shape),
        _ => flex_tensor(gelu::forward(values(&x)), shape),
    }
}

/// The backward node of the fused GELU.
#[derive(Debug)]
struct GeluBackward;

/// The GELU's recomputation from its input, for gradient checkpointing.
#[derive(Debug)]
struct RetroGelu {
    input: NodeId,
}

impl RetroForward for RetroGelu {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let x: FlexTensor = states.get_state(&self.input);
        states.save(out_node, forward(&x));
    }
}

impl Backward<Flex, 1> for GeluBackward {
    /// The forward input's checkpoint.
    type State = NodeId;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let x: FlexTensor = checkpointer.retrieve_node_output(ops.state);
        let dy: FlexTensor = grads.consume::<Flex>(&ops.node);
        let Some(node) = node_x else { return };
        grads.register::<Flex>(node.id, backward(&x, &dy));
    }
}

/// The GELU of `x`, recomputed, and the gradient of its input from `dy` (whose storage it
/// takes over when it owns it), in one pass (see [`gelu::recompute_backward`]).
pub(super) fn recompute_backward(x: &FlexTensor, dy: FlexTensor) -> (FlexTensor, FlexTensor) {
    let shape = x.shape();
    let x = contiguous(x);
    let mut grad = owned_contiguous(dy);
    let y = gelu::recompute_backward(values(&x), grad.storage_mut::<f32>());
    (flex_tensor(y, shape), grad)
}

/// The gradient `dy * (Φ(x) + x φ(x))` of the GELU's input (of `x`'s type).
pub(super) fn backward(x: &FlexTensor, dy: &FlexTensor) -> FlexTensor {
    let shape = x.shape();
    let (x, dy) = (contiguous(x), contiguous(dy));
    match x.dtype() {
        DType::BF16 => half_tensor(
            gelu::backward_half(half_values::<bf16>(&x), half_values::<bf16>(&dy)),
            shape,
        ),
        DType::F16 => half_tensor(
            gelu::backward_half(half_values::<f16>(&x), half_values::<f16>(&dy)),
            shape,
        ),
        _ => flex_tensor(gelu::backward(values(&x), values(&dy)), shape),
    }
}

/// The fused GELU under autodiff.
pub(super) fn tracked<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
) -> FloatTensor<Autodiff<Flex, C>> {
    match GeluBackward
        .prepare::<C>([x.node()])
        .memory_bound()
        .retro_forward(RetroGelu {
            input: x.node().id(),
        })
        .parents([&x])
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let state = prep.checkpoint(&x);
            prep.finish(state, forward(x.primitive()))
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(x.primitive())),
    }
}
