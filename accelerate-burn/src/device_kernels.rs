//! Our cubecl kernels ([`accelerate_kernels::cube`]) on Burn's GPU tensors, through a Burn
//! backend extension: gradients are unscaled and checked for overflow, and narrowed to half
//! precision for the wire, on the device where they already are. Only backends whose
//! [`AcceleratorBackend::DEVICE_KERNELS`](crate::AcceleratorBackend::DEVICE_KERNELS) is true
//! (wgpu, cuda) come here; the others keep the host kernels or Burn's own operations.

use accelerate_kernels::cube::Half;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{Int, Tensor};

use crate::error::AccelerateError;

/// The device kernels as Burn operations. Results that need the host (the overflow flag, the
/// narrowed bytes) come back as `Result`s with the runtime's error as text.
#[backend_extension(Cube: cfg(feature = "device-kernels"))]
pub(crate) trait GradientKernels: Backend {
    /// `grad` times `inv_scale` (in place where its buffer is not shared), and `flag` (one
    /// zeroed integer) set to non-zero if any result is not finite. One flag collects many
    /// calls and is read once.
    fn unscale_and_flag(
        grad: FloatTensor<Self>,
        flag: IntTensor<Self>,
        inv_scale: f32,
    ) -> (FloatTensor<Self>, IntTensor<Self>);

    /// `values` (returned untouched) and their bytes as f16 or bf16 after multiplying by
    /// `scale`.
    fn narrow_to_half(
        values: FloatTensor<Self>,
        bf16: bool,
        scale: f32,
    ) -> (FloatTensor<Self>, Result<Vec<u8>, String>);

    /// The f32 values of `packed` (f16 or bf16 bytes), as a tensor of `like`'s shape on its
    /// device; `like` itself is dropped.
    fn widen_from_half(like: FloatTensor<Self>, packed: Vec<u8>, bf16: bool) -> FloatTensor<Self>;
}

mod cube {
    use accelerate_kernels::cube::{self as kernels, Half, NonFiniteFlag};
    use burn::tensor::DType;
    use burn_cubecl::CubeBackend;
    use burn_cubecl::kernel::{cast, into_contiguous};
    use burn_cubecl::tensor::CubeTensor;

    use super::GradientKernels;

    /// `tensor` as contiguous f32 values.
    fn contiguous_f32(tensor: CubeTensor) -> CubeTensor {
        let tensor = if tensor.dtype == DType::F32 {
            tensor
        } else {
            cast(tensor, DType::F32)
        };
        if tensor.is_contiguous() {
            tensor
        } else {
            into_contiguous(tensor)
        }
    }

    fn half(bf16: bool) -> Half {
        if bf16 { Half::Bf16 } else { Half::F16 }
    }

    impl GradientKernels for CubeBackend {
        fn unscale_and_flag(
            grad: CubeTensor,
            flag: CubeTensor,
            inv_scale: f32,
        ) -> (CubeTensor, CubeTensor) {
            let dtype = grad.dtype;
            let mut values = contiguous_f32(grad);
            // A buffer another tensor still reads must not change under it.
            if !values.can_mut() {
                values = values.copy();
            }
            let len = values.meta.shape().num_elements();
            let device_flag = NonFiniteFlag::from_handle(flag.handle.clone());
            kernels::unscale_and_flag(
                &values.client,
                values.handle.clone(),
                len,
                inv_scale,
                &device_flag,
            );
            let values = if dtype == DType::F32 {
                values
            } else {
                cast(values, dtype)
            };
            (values, flag)
        }

        fn narrow_to_half(
            values: CubeTensor,
            bf16: bool,
            scale: f32,
        ) -> (CubeTensor, Result<Vec<u8>, String>) {
            let values = contiguous_f32(values);
            let len = values.meta.shape().num_elements();
            let packed = kernels::narrow_to_half(
                &values.client,
                values.handle.clone(),
                len,
                half(bf16),
                scale,
            );
            let bytes = values
                .client
                .read_one(packed)
                .map(|bytes| bytes[..len * 2].to_vec())
                .map_err(|e| e.to_string());
            (values, bytes)
        }

        fn widen_from_half(like: CubeTensor, packed: Vec<u8>, bf16: bool) -> CubeTensor {
            let len = packed.len() / 2;
            // Whole words: an odd count leaves the last word's high half unread.
            let mut words = packed;
            words.resize(len.div_ceil(2) * 4, 0);
            let input = like.client.create_from_slice(&words);
            let output = kernels::widen_from_half(&like.client, input, len, half(bf16));
            CubeTensor::new_contiguous(
                like.client.clone(),
                like.device.clone(),
                like.meta.shape().clone(),
                output,
                DType::F32,
            )
        }
    }
}

fn device_error(rank: usize, op: &'static str, detail: String) -> AccelerateError {
    AccelerateError::Tensor { rank, op, detail }
}

/// Unscales `grads` on their device and says whether any value is not finite (the step must
/// be skipped). One kernel per tensor, one read of a 4-byte flag in all.
pub(crate) fn unscale_and_check<const D: usize>(
    grads: Vec<Tensor<D>>,
    inv_scale: f32,
) -> (Vec<Tensor<D>>, bool) {
    let Some(device) = grads.first().map(Tensor::device) else {
        return (grads, false);
    };
    let mut flag = Tensor::<1, Int>::zeros([1], &device).into_dispatch();
    let mut unscaled = Vec::with_capacity(grads.len());
    for grad in grads {
        let (grad, next) =
            <Dispatch as GradientKernels>::unscale_and_flag(grad.into_dispatch(), flag, inv_scale);
        unscaled.push(Tensor::from_dispatch(grad));
        flag = next;
    }
    let found = Tensor::<1, Int>::from_dispatch(flag)
        .into_data()
        .iter::<i64>()
        .any(|v| v != 0);
    (unscaled, found)
}

/// `values` times `scale`, narrowed to `half` on the device: the bytes of a `[f16]`/`[bf16]`
/// slice. `values` comes back unchanged.
pub(crate) fn narrow_to_half(
    values: Tensor<1>,
    half: Half,
    scale: f32,
    rank: usize,
) -> Result<(Tensor<1>, Vec<u8>), AccelerateError> {
    let (values, bytes) = <Dispatch as GradientKernels>::narrow_to_half(
        values.into_dispatch(),
        half == Half::Bf16,
        scale,
    );
    let bytes = bytes.map_err(|e| device_error(rank, "narrowing gradients on the device", e))?;
    Ok((Tensor::from_dispatch(values), bytes))
}

/// The f32 values of `packed` (`half` bytes) on `like`'s device, in `like`'s shape.
pub(crate) fn widen_from_half(like: Tensor<1>, packed: Vec<u8>, half: Half) -> Tensor<1> {
    Tensor::from_dispatch(<Dispatch as GradientKernels>::widen_from_half(
        like.into_dispatch(),
        packed,
        half == Half::Bf16,
    ))
}
