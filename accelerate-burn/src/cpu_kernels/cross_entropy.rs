//! The fused softmax cross-entropy: [`accelerate_kernels::cross_entropy`] on Flex tensors, and
//! its backward node (state: the logits, the targets and each row's log-sum-exp).

use accelerate_kernels::cross_entropy;
use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::tensor::DType;

use super::{contiguous, flex_tensor, row_shape, values};

/// The targets as `i64`, whatever integer type Flex holds them in.
pub(super) fn target_classes(targets: &FlexTensor) -> Vec<i64> {
    let targets = contiguous(targets);
    match targets.dtype() {
        DType::I64 => targets.as_slice::<i64>().unwrap_or(&[]).to_vec(),
        DType::I32 => widen(targets.as_slice::<i32>()),
        DType::I16 => widen(targets.as_slice::<i16>()),
        DType::I8 => widen(targets.as_slice::<i8>()),
        DType::U64 => targets
            .as_slice::<u64>()
            .unwrap_or(&[])
            .iter()
            .map(|&t| i64::try_from(t).unwrap_or(i64::MAX))
            .collect(),
        DType::U32 => widen(targets.as_slice::<u32>()),
        DType::U16 => widen(targets.as_slice::<u16>()),
        DType::U8 => widen(targets.as_slice::<u8>()),
        other => panic!("cross_entropy: targets of type {other:?} are not class indices"),
    }
}

/// Integers of a narrower type, as `i64`.
fn widen<T: Copy + Into<i64>>(values: Option<&[T]>) -> Vec<i64> {
    values.unwrap_or(&[]).iter().map(|&v| v.into()).collect()
}

/// Each row's loss against `classes` (the targets' [`target_classes`]), and its log-sum-exp.
pub(super) fn forward(logits: &FlexTensor, classes: &[i64]) -> (FlexTensor, Vec<f32>) {
    let shape = logits.shape();
    let rows = row_shape(&shape);
    let logits = contiguous(logits);
    let mut losses = vec![0.0; rows.rows];
    let mut lse = vec![0.0; rows.rows];
    cross_entropy::forward(rows, values(&logits), classes, &mut losses, &mut lse);
    (flex_tensor(losses, [rows.rows].into()), lse)
}

/// The backward node of the fused cross-entropy.
#[derive(Debug)]
struct CrossEntropyBackward;

impl Backward<Flex, 1> for CrossEntropyBackward {
    /// The logits, the target classes, and each row's log-sum-exp.
    type State = (FlexTensor, Vec<i64>, Vec<f32>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_logits] = ops.parents;
        let dlosses: FlexTensor = grads.consume::<Flex>(&ops.node);
        let Some(node) = node_logits else { return };
        let (logits, classes, lse) = ops.state;
        let shape = logits.shape();
        let (logits, dlosses) = (contiguous(&logits), contiguous(&dlosses));
        let mut dlogits = vec![0.0; shape.num_elements()];
        cross_entropy::backward(
            row_shape(&shape),
            values(&logits),
            &classes,
            &lse,
            values(&dlosses),
            &mut dlogits,
        );
        grads.register::<Flex>(node.id, flex_tensor(dlogits, shape));
    }
}

/// The fused cross-entropy under autodiff (the targets are not differentiable).
pub(super) fn tracked<C: CheckpointStrategy>(
    logits: FloatTensor<Autodiff<Flex, C>>,
    targets: IntTensor<Autodiff<Flex, C>>,
) -> FloatTensor<Autodiff<Flex, C>> {
    let classes = target_classes(&targets);
    let (losses, lse) = forward(logits.primitive(), &classes);
    match CrossEntropyBackward
        .prepare::<C>([logits.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((logits.primitive().clone(), classes, lse), losses),
        OpsKind::UnTracked(prep) => prep.finish(losses),
    }
}
