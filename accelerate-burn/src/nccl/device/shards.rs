//! NCCL on one sharded parameter's cubecl tensors (ZeRO-3's gather and its backward on the cuda
//! backend). Called from inside the gather's Burn operation, where the tensors are already the
//! unfused backend's: under Burn's fusion the operation's own fused half resolved them.

use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use super::{CallKind, GpuError, NcclKernels};
use crate::nccl::DeviceCollectives;
use accelerate_core::nccl::NcclDataType;

impl DeviceCollectives {
    /// Every rank's `shard` (one dimension, f32, bf16 or f16, the same length on every rank),
    /// concatenated in rank order, in the shard's type.
    pub fn gather_shard(&self, shard: CubeTensor) -> Result<CubeTensor, GpuError> {
        let dtype = nccl_type(shard.dtype)?;
        let world = self.lock().comm.world_size();
        let shard = into_contiguous(shard);
        let len = shard.meta.shape().num_elements() * world;
        let out = CubeBackend::float_empty(Shape::new([len]), &shard.device, shard.dtype.into());
        let call = self.call(CallKind::AllGather, dtype);
        let (out, result) = <CubeBackend as NcclKernels>::nccl_collective(shard, out, call);
        result.map(|()| out)
    }

    /// This rank's `shard_len` elements of the mean of `values` (f32, `shard_len * world`
    /// elements) over the ranks.
    pub fn reduce_scatter_shard(
        &self,
        values: CubeTensor,
        shard_len: usize,
    ) -> Result<CubeTensor, GpuError> {
        let values = into_contiguous(values);
        let out = CubeBackend::float_empty(
            Shape::new([shard_len]),
            &values.device,
            burn::tensor::FloatDType::F32,
        );
        let call = self.call(CallKind::ReduceScatterMean, NcclDataType::F32);
        let (out, result) = <CubeBackend as NcclKernels>::nccl_collective(values, out, call);
        result.map(|()| out)
    }
}

/// NCCL's name for a parameter's type.
fn nccl_type(dtype: DType) -> Result<NcclDataType, GpuError> {
    match dtype {
        DType::F32 => Ok(NcclDataType::F32),
        DType::BF16 => Ok(NcclDataType::Bf16),
        DType::F16 => Ok(NcclDataType::F16),
        other => Err(GpuError::DType {
            wanted: DType::F32,
            input: other,
            output: other,
        }),
    }
}
