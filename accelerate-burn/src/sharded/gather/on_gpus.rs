//! The gather and its backward on the GPUs, for a job that uses NCCL (the cuda backend, built
//! with `nccl`): the shard and the gradient never leave the device. The results are those of
//! the host path's collectives: the gathered parameter is every rank's shard in rank order,
//! the gradient's shard the mean over the ranks (NCCL's average, in f32).
//!
//! Failures are recorded in the [`ShardGroup`](super::ShardGroup), as on the host path, and the
//! operation gives zeros.

use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, FloatDType, Shape, Slice};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

use super::{ParamShard, zeros};
use crate::nccl::DeviceCollectives;

/// The parameter from every rank's shard, gathered by NCCL in the shard's type (half precision
/// under autocast).
pub(super) fn gather(
    nccl: &DeviceCollectives,
    shard: CubeTensor,
    param: &ParamShard,
) -> CubeTensor {
    let (device, dtype) = (shard.device.clone(), shard.dtype);
    let group = &param.group;
    if !group.failed() {
        group.count_gather();
        match group.comm().timed_device(|| nccl.gather_shard(shard)) {
            Ok(all) => {
                // Every rank's shard, the last padded: the parameter is the first `numel`.
                let all = CubeBackend::float_slice(all, &[Slice::from(0..param.numel)]);
                return CubeBackend::float_reshape(all, Shape::from(param.shape.clone()));
            }
            Err(e) => group.record_other(format!("gathering on the GPU with NCCL: {e}")),
        }
    }
    CubeBackend::float_from_data(zeros(&param.shape, dtype), &device)
}

/// This rank's shard of the mean of every rank's gradient `grad`, in f32 (see the host path's
/// `reduce_scatter` for why).
pub(super) fn reduce_scatter(
    nccl: &DeviceCollectives,
    grad: CubeTensor,
    param: &ParamShard,
) -> CubeTensor {
    let device = grad.device.clone();
    let group = &param.group;
    if !group.failed() {
        let flat = CubeBackend::float_reshape(
            CubeBackend::float_cast(grad, FloatDType::F32),
            Shape::new([param.numel]),
        );
        let padded_len = param.shard_len * group.world_size();
        // The padding of the last shard is zeros, as on the host path.
        let input = match padded_len.checked_sub(param.numel) {
            Some(0) => flat,
            Some(pad) => {
                let zeros = CubeBackend::float_zeros(Shape::new([pad]), &device, FloatDType::F32);
                CubeBackend::float_cat(vec![flat, zeros], 0)
            }
            None => {
                group.record_other(format!(
                    "a shard of {} elements over {} ranks cannot hold a parameter of {}",
                    param.shard_len,
                    group.world_size(),
                    param.numel
                ));
                return CubeBackend::float_from_data(
                    zeros(&[param.shard_len], DType::F32),
                    &device,
                );
            }
        };
        let shard_len = param.shard_len;
        match group
            .comm()
            .timed_device(|| nccl.reduce_scatter_shard(input, shard_len))
        {
            Ok(shard) => return shard,
            Err(e) => group.record_other(format!("reduce-scattering on the GPU with NCCL: {e}")),
        }
    }
    CubeBackend::float_from_data(zeros(&[param.shard_len], DType::F32), &device)
}
