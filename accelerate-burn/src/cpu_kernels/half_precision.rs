//! The half-precision element types (bf16, f16) our kernels read and write in place, and the
//! Flex tensors of them.

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
