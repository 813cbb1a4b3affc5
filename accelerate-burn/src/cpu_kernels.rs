//! Our CPU kernels ([`accelerate_kernels::layer_norm`]) on Burn's Flex tensors, with our own
//! backward nodes on `Autodiff<Flex>`, through a Burn backend extension.
//!
//! Burn's autodiff has no backward pass of its own for layer norm: it runs the backend trait's
//! default decomposition (mean, subtract, square, mean, add, sqrt, divide, reshape, multiply,
//! add), each a tracked operation with its own backward, so one layer norm costs about thirty
//! passes over the tensor when training, most of them on one core. Here it is one parallel pass
//! forward and one backward.
//!
//! Only f32 tensors on Flex (plain or under autodiff) come here: [`crate::nn`] checks the
//! device and the type first and uses Burn's own operations everywhere else, so calling these
//! on another backend (which panics) cannot happen.

use accelerate_kernels::layer_norm::{self, Shape as RowShape};
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{DType, TensorData};

/// The fused CPU operations, as Burn operations.
#[backend_extension(Flex, Autodiff)]
pub(crate) trait CpuKernels: Backend {
    /// Layer norm over the last dimension of `x` (f32): `(x - mean) / sqrt(var + epsilon) *
    /// gamma + beta`, with the biased variance, as Burn's `layer_norm`.
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self>;
}

/// `tensor`'s f32 values in row-major order: borrowed when contiguous, else a copy.
fn contiguous(tensor: &FlexTensor) -> FlexTensor {
    if tensor.as_slice::<f32>().is_some() {
        tensor.clone()
    } else {
        tensor.to_contiguous()
    }
}

/// The f32 slice of a contiguous tensor (`contiguous` made it so).
fn values(tensor: &FlexTensor) -> &[f32] {
    tensor.as_slice::<f32>().unwrap_or(&[])
}

/// A Flex tensor of `shape` holding `values`.
fn flex_tensor(values: Vec<f32>, shape: burn::tensor::Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// The rows and width of a layer norm over the last dimension of `shape`.
fn row_shape(shape: &burn::tensor::Shape) -> RowShape {
    let dims = shape.as_slice();
    let width = dims.last().copied().unwrap_or(1);
    RowShape {
        rows: shape.num_elements().checked_div(width).unwrap_or(0),
        width,
    }
}

/// The forward pass: the output, and each row's mean and reciprocal standard deviation.
fn layer_norm_forward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: &FlexTensor,
    epsilon: f64,
) -> (FlexTensor, FlexTensor) {
    let shape = x.shape();
    let rows = row_shape(&shape);
    let (x, gamma, beta) = (contiguous(x), contiguous(gamma), contiguous(beta));
    let mut y = vec![0.0; rows.rows * rows.width];
    let mut stats = vec![0.0; 2 * rows.rows];
    layer_norm::forward(
        rows,
        values(&x),
        values(&gamma),
        Some(values(&beta)),
        epsilon as f32,
        &mut y,
        &mut stats,
    );
    let stats_len = stats.len();
    (
        flex_tensor(y, shape),
        flex_tensor(stats, [stats_len].into()),
    )
}

impl CpuKernels for Flex {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        layer_norm_forward(&x, &gamma, &beta, epsilon).0
    }
}

/// The backward node of the fused layer norm: its parents are `x`, `gamma` and `beta`.
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
        let (x, gamma, dy) = (contiguous(&x), contiguous(&gamma), contiguous(&dy));
        let mut dx = vec![0.0; rows.rows * rows.width];
        let mut dgamma = vec![0.0; rows.width];
        let mut dbeta = vec![0.0; rows.width];
        layer_norm::backward(
            rows,
            values(&x),
            values(&gamma),
            values(&stats),
            values(&dy),
            &mut dx,
            &mut dgamma,
            &mut dbeta,
        );
        let width: burn::tensor::Shape = [rows.width].into();
        if let Some(node) = node_x {
            grads.register::<Flex>(node.id, flex_tensor(dx, shape));
        }
        if let Some(node) = node_gamma {
            grads.register::<Flex>(node.id, flex_tensor(dgamma, width.clone()));
        }
        if let Some(node) = node_beta {
            grads.register::<Flex>(node.id, flex_tensor(dbeta, width));
        }
    }
}

impl<C: CheckpointStrategy> CpuKernels for Autodiff<Flex, C> {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        // Compute-bound for checkpointing: the statistics are kept, never recomputed.
        match LayerNormBackward
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, stats) =
                    layer_norm_forward(x.primitive(), gamma.primitive(), beta.primitive(), epsilon);
                let state = (x.primitive().clone(), gamma.primitive().clone(), stats);
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(
                layer_norm_forward(x.primitive(), gamma.primitive(), beta.primitive(), epsilon).0,
            ),
        }
    }
}

/// Whether `dtype` is one the fused kernels compute in.
pub(crate) fn supported(dtype: DType) -> bool {
    dtype == DType::F32
}

/// The fused layer norm of dispatch tensors (f32 on Flex, plain or under autodiff).
pub(crate) fn layer_norm<const D: usize>(
    x: burn::tensor::Tensor<D>,
    gamma: burn::tensor::Tensor<1>,
    beta: burn::tensor::Tensor<1>,
    epsilon: f64,
) -> burn::tensor::Tensor<D> {
    burn::tensor::Tensor::from_dispatch(<Dispatch as CpuKernels>::fused_layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
    ))
}
