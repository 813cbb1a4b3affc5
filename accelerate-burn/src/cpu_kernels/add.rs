//! The sum of two bf16 or f16 tensors of one shape on Flex ([`accelerate_kernels::add::add`]:
//! parallel, each value computed in f32 and rounded once, the bits Flex gives), and its
//! backward node (the gradient passed to both). Flex adds half-precision values one at a time
//! on the calling thread: an fp16 step's residual connections kept the second core waiting.

use accelerate_kernels::add::add;
use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, bf16, f16};

use super::{Half, contiguous, half_tensor, half_values};

/// `a + b` of one shape: ours for two bf16 or two f16 tensors, Flex's add otherwise.
///
/// # Panics
/// When the shapes differ: the backward node passes the gradient on unchanged, which is
/// only right without broadcasting (`nn::add` checks the shapes first).
pub(super) fn forward(a: &FlexTensor, b: &FlexTensor) -> FlexTensor {
    assert_eq!(
        a.shape(),
        b.shape(),
        "fused_add: the shapes differ (no broadcasting here)"
    );
    if a.dtype() != b.dtype() {
        return Flex::float_add(a.clone(), b.clone());
    }
    match a.dtype() {
        DType::BF16 => sum::<bf16>(a, b),
        DType::F16 => sum::<f16>(a, b),
        _ => Flex::float_add(a.clone(), b.clone()),
    }
}

/// The sum of two `T` tensors of one shape.
fn sum<T: Half>(a: &FlexTensor, b: &FlexTensor) -> FlexTensor {
    let (a, b) = (contiguous(a), contiguous(b));
    half_tensor(add(half_values::<T>(&a), half_values::<T>(&b)), a.shape())
}

/// The backward node of the sum: the output's gradient is each input's.
#[derive(Debug)]
struct AddBackward;

impl Backward<Flex, 2> for AddBackward {
    type State = ();

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_a, node_b] = ops.parents;
        let dy: FlexTensor = grads.consume::<Flex>(&ops.node);
        for node in [node_a, node_b].into_iter().flatten() {
            grads.register::<Flex>(node.id, dy.clone());
        }
    }
}

/// The sum under autodiff.
pub(super) fn tracked<C: CheckpointStrategy>(
    a: FloatTensor<Autodiff<Flex, C>>,
    b: FloatTensor<Autodiff<Flex, C>>,
) -> FloatTensor<Autodiff<Flex, C>> {
    let out = forward(a.primitive(), b.primitive());
    AddBackward
        .prepare::<C>([a.node(), b.node()])
        .compute_bound()
        .stateless(out)
}
