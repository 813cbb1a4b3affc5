//! The fused linear layer: [`accelerate_kernels::linear`] on Flex tensors, and its backward node
//! (state: the input and the weight, by checkpoint).
//!
//! The products are the `gemm` crate's, as in Burn's `linear`; what goes is the work Burn does
//! on the calling thread around each one (a zero-filled output copied again for alignment, a
//! separate bias pass, a single-threaded bias gradient), which left the second core idle for
//! about a fifth of a transformer's step.
//!
//! bf16 and f16 tensors (autocast) take [`accelerate_kernels::bf16_matmul`]'s products instead:
//! half-precision operands, f32 accumulation, each result rounded once to the tensor's type as
//! the product stores it (no f32 copy); the bias added and its gradient summed in f32. Burn's
//! Flex widens both operands to f32 and narrows the result for every half-precision product.

use accelerate_kernels::bf16_matmul::{Bf16Path, HalfMat, matmul_half_to};
use accelerate_kernels::cast::cast;
use accelerate_kernels::linear::{self, Weight};
use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Shape, bf16, f16};

use super::{Half, contiguous, flex_tensor, half_tensor, half_values, values};

/// A `[d_in, d_out]` weight read in place when its strides allow (a transposed view included),
/// else from a contiguous copy.
pub(super) struct WeightView {
    tensor: FlexTensor,
    offset: usize,
    row_stride: usize,
    col_stride: usize,
    d_in: usize,
    d_out: usize,
}

impl WeightView {
    /// The view of `weight` (`[d_in, d_out]`).
    pub(super) fn of(weight: &FlexTensor) -> Self {
        let shape = weight.shape();
        let [d_in, d_out] = match shape.as_slice() {
            [d_in, d_out] => [*d_in, *d_out],
            dims => panic!("linear: a weight of shape {dims:?}, not [d_in, d_out]"),
        };
        let layout = weight.layout();
        let strides = match layout.strides() {
            [rows, cols] => usize::try_from(*rows).ok().zip(usize::try_from(*cols).ok()),
            _ => None,
        };
        match strides {
            Some((row_stride, col_stride)) => Self {
                tensor: weight.clone(),
                offset: layout.start_offset(),
                row_stride,
                col_stride,
                d_in,
                d_out,
            },
            None => Self {
                tensor: weight.to_contiguous(),
                offset: 0,
                row_stride: d_out,
                col_stride: 1,
                d_in,
                d_out,
            },
        }
    }

    /// The weight as a half-precision matrix view (a weight of type `T`).
    fn half<T: Half>(&self) -> HalfMat<'_, T> {
        HalfMat {
            data: self.tensor.storage::<T>(),
            offset: self.offset,
            rows: self.d_in,
            cols: self.d_out,
            row_stride: self.row_stride,
            col_stride: self.col_stride,
        }
    }

    fn weight(&self) -> Weight<'_> {
        Weight {
            data: self.tensor.storage::<f32>(),
            offset: self.offset,
            d_in: self.d_in,
            d_out: self.d_out,
            row_stride: self.row_stride,
            col_stride: self.col_stride,
        }
    }
}

/// `shape` with its last dimension `width`.
fn with_last(shape: &Shape, width: usize) -> Shape {
    let mut dims = shape.as_slice().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = width;
    }
    dims.into()
}

/// `rows x width` row-major values as a matrix view.
fn half_rows<T: Half>(values: &[T], width: usize) -> HalfMat<'_, T> {
    HalfMat::row_major(values, values.len().checked_div(width).unwrap_or(0), width)
}

/// The half-precision forward: `x W` (+ the bias, in f32), rounded once as the product
/// stores it.
fn forward_half<T: Half>(
    x: &FlexTensor,
    view: &WeightView,
    bias: Option<&FlexTensor>,
    shape: Shape,
) -> FlexTensor {
    let bias = bias.map(|bias| cast::<T, f32>(half_values::<T>(bias)));
    let y: Vec<T> = matmul_half_to(
        Bf16Path::detect(),
        half_rows(half_values::<T>(x), view.d_in),
        view.half(),
        bias.as_deref(),
    );
    half_tensor(y, shape)
}

/// The half-precision input gradient `dy W^T`, rounded once.
fn input_grad_half<T: Half>(dy: &FlexTensor, view: &WeightView, shape: Shape) -> FlexTensor {
    let dx: Vec<T> = matmul_half_to(
        Bf16Path::detect(),
        half_rows(half_values::<T>(dy), view.d_out),
        view.half::<T>().t(),
        None,
    );
    half_tensor(dx, shape)
}

/// The half-precision weight gradient `x^T dy`, rounded once.
fn weight_grad_half<T: Half>(
    x: &FlexTensor,
    dy: &FlexTensor,
    d_in: usize,
    d_out: usize,
) -> FlexTensor {
    let grad: Vec<T> = matmul_half_to(
        Bf16Path::detect(),
        half_rows(half_values::<T>(x), d_in).t(),
        half_rows(half_values::<T>(dy), d_out),
        None,
    );
    half_tensor(grad, [d_in, d_out].into())
}

/// The half-precision bias gradient, summed in f32 and rounded once.
fn bias_grad_half<T: Half>(dy: &FlexTensor, d_out: usize) -> FlexTensor {
    let sums = linear::bias_grad(half_values::<T>(dy), d_out);
    half_tensor(cast::<f32, T>(&sums), [d_out].into())
}

/// `x W (+ b)` of Flex tensors, `x` `[..., d_in]`.
pub(super) fn forward(
    x: &FlexTensor,
    weight: &FlexTensor,
    bias: Option<&FlexTensor>,
) -> FlexTensor {
    let view = WeightView::of(weight);
    let shape = with_last(&x.shape(), view.d_out);
    let x = contiguous(x);
    let bias = bias.map(contiguous);
    match x.dtype() {
        DType::BF16 => return forward_half::<bf16>(&x, &view, bias.as_ref(), shape),
        DType::F16 => return forward_half::<f16>(&x, &view, bias.as_ref(), shape),
        _ => {}
    }
    let y = linear::forward(values(&x), view.weight(), bias.as_ref().map(values));
    flex_tensor(y, shape)
}

/// `dy W^T`, shaped as `dy` with its last dimension `d_in`.
pub(super) fn input_grad(dy: &FlexTensor, weight: &FlexTensor) -> FlexTensor {
    let view = WeightView::of(weight);
    let shape = with_last(&dy.shape(), view.d_in);
    let dy = contiguous(dy);
    match dy.dtype() {
        DType::BF16 => return input_grad_half::<bf16>(&dy, &view, shape),
        DType::F16 => return input_grad_half::<f16>(&dy, &view, shape),
        _ => {}
    }
    flex_tensor(linear::input_grad(values(&dy), view.weight()), shape)
}

/// `x^T dy` over every leading dimension, `[d_in, d_out]`.
pub(super) fn weight_grad(x: &FlexTensor, dy: &FlexTensor) -> FlexTensor {
    let d_in = x.shape().as_slice().last().copied().unwrap_or(1);
    let d_out = dy.shape().as_slice().last().copied().unwrap_or(1);
    let (x, dy) = (contiguous(x), contiguous(dy));
    match dy.dtype() {
        DType::BF16 => return weight_grad_half::<bf16>(&x, &dy, d_in, d_out),
        DType::F16 => return weight_grad_half::<f16>(&x, &dy, d_in, d_out),
        _ => {}
    }
    let grad = linear::weight_grad(values(&x), values(&dy), d_in, d_out);
    flex_tensor(grad, [d_in, d_out].into())
}

/// The sums of `dy` over every leading dimension, `[d_out]` (summed in f32 for half types).
pub(super) fn bias_grad(dy: &FlexTensor) -> FlexTensor {
    let d_out = dy.shape().as_slice().last().copied().unwrap_or(1);
    let dy = contiguous(dy);
    match dy.dtype() {
        DType::BF16 => return bias_grad_half::<bf16>(&dy, d_out),
        DType::F16 => return bias_grad_half::<f16>(&dy, d_out),
        _ => {}
    }
    flex_tensor(linear::bias_grad(values(&dy), d_out), [d_out].into())
}

/// The backward node of the fused linear layer, with a bias (3 parents) or without (2).
#[derive(Debug)]
struct LinearBackward;

impl LinearBackward {
    /// Registers the gradients of the input, the weight and the bias that are tracked.
    fn register(
        parents: [Option<NodeId>; 3],
        (x_state, weight_state): (NodeId, NodeId),
        dy: FlexTensor,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_weight, node_bias] = parents;
        let x: FlexTensor = checkpointer.retrieve_node_output(x_state);
        let weight: FlexTensor = checkpointer.retrieve_node_output(weight_state);
        let dy = contiguous(&dy);
        if let Some(node) = node_bias {
            grads.register::<Flex>(node, bias_grad(&dy));
        }
        if let Some(node) = node_weight {
            grads.register::<Flex>(node, weight_grad(&x, &dy));
        }
        if let Some(node) = node_x {
            grads.register::<Flex>(node, input_grad(&dy, &weight));
        }
    }
}

impl Backward<Flex, 3> for LinearBackward {
    /// The checkpoints of `x` and of the weight.
    type State = (NodeId, NodeId);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let dy: FlexTensor = grads.consume::<Flex>(&ops.node);
        let parents = ops.parents.map(|parent| parent.map(|node| node.id));
        Self::register(parents, ops.state, dy, grads, checkpointer);
    }
}

impl Backward<Flex, 2> for LinearBackward {
    /// The checkpoints of `x` and of the weight.
    type State = (NodeId, NodeId);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let dy: FlexTensor = grads.consume::<Flex>(&ops.node);
        let [x, weight] = ops.parents.map(|parent| parent.map(|node| node.id));
        Self::register([x, weight, None], ops.state, dy, grads, checkpointer);
    }
}

/// The fused linear layer under autodiff, with or without a bias.
pub(super) fn tracked<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
    weight: FloatTensor<Autodiff<Flex, C>>,
    bias: Option<FloatTensor<Autodiff<Flex, C>>>,
) -> FloatTensor<Autodiff<Flex, C>> {
    let y = forward(
        x.primitive(),
        weight.primitive(),
        bias.as_ref().map(|bias| bias.primitive()),
    );
    match bias {
        Some(bias) => record::<C, 3>([x.node(), weight.node(), bias.node()], &x, &weight, y),
        None => record::<C, 2>([x.node(), weight.node()], &x, &weight, y),
    }
}

/// Records the linear layer's backward node over `parents` (the input, the weight, and the
/// bias when there is one), keeping the input and the weight by checkpoint. Compute-bound for
/// checkpointing (a matrix product): its output is kept when a later recomputation needs it,
/// never recomputed.
fn record<C: CheckpointStrategy, const N: usize>(
    parents: [NodeGuard; N],
    x: &FloatTensor<Autodiff<Flex, C>>,
    weight: &FloatTensor<Autodiff<Flex, C>>,
    y: FlexTensor,
) -> FloatTensor<Autodiff<Flex, C>>
where
    LinearBackward: Backward<Flex, N, State = (NodeId, NodeId)>,
{
    match LinearBackward
        .prepare::<C>(parents)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let state = (prep.checkpoint(x), prep.checkpoint(weight));
            prep.finish(state, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}
