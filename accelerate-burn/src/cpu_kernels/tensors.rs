//! The Flex tensors our kernels read and write: their values as slices (f32, and the
//! half-precision types bf16 and f16 read and written in place), contiguous copies where a
//! layout needs one, and new tensors from the kernels' outputs.

use accelerate_kernels::rows::Shape as RowShape;
use burn::backend::TensorMetadata;
use burn::backend::flex::FlexTensor;
use burn::tensor::TensorData;

/// The half-precision types (bf16, f16) the kernels read and write in place.
pub(super) trait Half:
    accelerate_kernels::Element + accelerate_kernels::bf16_matmul::HalfElement + burn::tensor::Element
{
}

impl Half for burn::tensor::bf16 {}
impl Half for burn::tensor::f16 {}

/// The values of a contiguous tensor of type `T`.
pub(super) fn half_values<T: Half>(tensor: &FlexTensor) -> &[T] {
    tensor.as_slice::<T>().unwrap_or(&[])
}

/// A Flex tensor of type `T` and `shape` holding `values`.
pub(super) fn half_tensor<T: Half>(values: Vec<T>, shape: burn::tensor::Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// `tensor`'s values in row-major order: borrowed when contiguous, else a copy.
pub(super) fn contiguous(tensor: &FlexTensor) -> FlexTensor {
    if tensor.layout().contiguous_offsets().is_some() {
        tensor.clone()
    } else {
        tensor.to_contiguous()
    }
}

/// `tensor` with row-major storage holding exactly its values, for a kernel that writes in
/// place: itself when its storage already is that (`storage_mut` then copies only if the
/// storage is shared), else a contiguous copy.
pub(super) fn owned_contiguous(tensor: FlexTensor) -> FlexTensor {
    let n = tensor.shape().num_elements();
    let exact =
        tensor.layout().contiguous_offsets() == Some((0, n)) && tensor.storage::<f32>().len() == n;
    if exact {
        tensor
    } else {
        tensor.to_contiguous()
    }
}

/// The f32 slice of a contiguous f32 tensor (`contiguous` made it so).
pub(super) fn values(tensor: &FlexTensor) -> &[f32] {
    tensor.as_slice::<f32>().unwrap_or(&[])
}

/// A Flex tensor of `shape` holding `values`.
pub(super) fn flex_tensor(values: Vec<f32>, shape: burn::tensor::Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// The rows of `shape`'s last dimension.
pub(super) fn row_shape(shape: &burn::tensor::Shape) -> RowShape {
    let dims = shape.as_slice();
    let width = dims.last().copied().unwrap_or(1);
    RowShape {
        rows: shape.num_elements().checked_div(width).unwrap_or(0),
        width,
    }
}
