//! Casts between f32, bf16 and f16 on Flex ([`accelerate_kernels::cast::cast`], parallel and
//! vectorised), and their backward node (the gradient cast back to the input's type). Flex
//! converts one element at a time on the calling thread: autocast's casts of the weights, the
//! activations around our f32-only kernels and the weight gradients were 5 % of a bf16 step
//! and a quarter of the time the second core waited (RESULTS, issue 60).

use accelerate_kernels::Element as KernelElement;
use accelerate_kernels::cast::cast;
use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, FloatDType, TensorData, bf16, f16};

use super::contiguous;

/// `x` (f32, bf16 or f16) as `dtype`; other types are refused by the caller's check.
pub(super) fn forward(x: &FlexTensor, dtype: FloatDType) -> FlexTensor {
    let to = DType::from(dtype);
    if x.dtype() == to {
        return x.clone();
    }
    let x = contiguous(x);
    match x.dtype() {
        DType::F32 => from::<f32>(&x, to),
        DType::BF16 => from::<bf16>(&x, to),
        DType::F16 => from::<f16>(&x, to),
        other => panic!("cast: a {other:?} tensor is not f32, bf16 or f16"),
    }
}

/// `x` widened to f32 (itself when it is f32): what a kernel computing half precision in f32
/// reads.
pub(super) fn widened(x: &FlexTensor) -> FlexTensor {
    forward(x, FloatDType::F32)
}

/// The contiguous `x` of type `S` converted to `to`.
fn from<S: KernelElement + burn::tensor::Element>(x: &FlexTensor, to: DType) -> FlexTensor {
    let values = x.as_slice::<S>().unwrap_or(&[]);
    let shape = x.shape();
    let data = match to {
        DType::F32 => TensorData::new(cast::<S, f32>(values), shape),
        DType::BF16 => TensorData::new(cast::<S, bf16>(values), shape),
        DType::F16 => TensorData::new(cast::<S, f16>(values), shape),
        other => panic!("cast: to {other:?}, not f32, bf16 or f16"),
    };
    FlexTensor::from_data(data)
}

/// The backward node of the cast: the gradient cast back to the input's type.
#[derive(Debug)]
struct CastBackward;

impl Backward<Flex, 1> for CastBackward {
    /// The input's type.
    type State = FloatDType;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let dy: FlexTensor = grads.consume::<Flex>(&ops.node);
        let Some(node) = node_x else { return };
        grads.register::<Flex>(node.id, forward(&dy, ops.state));
    }
}

/// The cast under autodiff.
pub(super) fn tracked<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
    dtype: FloatDType,
) -> FloatTensor<Autodiff<Flex, C>> {
    let input_dtype = FloatDType::from(x.primitive().dtype());
    match CastBackward
        .prepare::<C>([x.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(input_dtype, forward(x.primitive(), dtype)),
        OpsKind::UnTracked(prep) => prep.finish(forward(x.primitive(), dtype)),
    }
}
