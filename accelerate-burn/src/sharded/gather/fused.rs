//! The gather on Burn's fused GPU tensors, written out rather than generated: a generated
//! fused operation is lazy, run whenever the stream is flushed, and a collective must run
//! where the program calls it. The host path reads its tensor (which drains the stream) as on
//! any backend; NCCL's path resolves its tensor through the fusion client, runs on the cubecl
//! tensor underneath, and hands the result back to the stream.

use burn::backend::fusion::{Fusion, FusionTensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;

use super::{AnchorGate, GatherSpec, ParamShard, ShardOps, gather, on_gpus, reduce_scatter};
use crate::backend::fusion::register;
use crate::nccl::DeviceCollectives;
use crate::overlap::TapSpec;

type Fused = FusionTensor<FusionCubeRuntime>;

impl ShardOps for Fusion<CubeBackend> {
    fn shard_anchor(input: Fused, _: AnchorGate) -> Fused {
        input
    }

    fn shard_gather(shard: Fused, _: Fused, spec: GatherSpec) -> Fused {
        collective(shard, &spec.0, gather::<Self>, on_gpus::gather)
    }

    fn shard_reduce_scatter(grad: Fused, spec: GatherSpec) -> Fused {
        collective(
            grad,
            &spec.0,
            reduce_scatter::<Self>,
            on_gpus::reduce_scatter,
        )
    }

    fn unit_tap(param: Fused, _: Fused, _: TapSpec) -> Fused {
        param
    }
}

/// `tensor` through `on_gpus` on the cubecl tensor underneath where the job uses NCCL (its
/// result handed back to the stream), else through `on_host`.
fn collective(
    tensor: Fused,
    param: &ParamShard,
    on_host: fn(Fused, &ParamShard) -> Fused,
    on_gpus: fn(&DeviceCollectives, CubeTensor, &ParamShard) -> CubeTensor,
) -> Fused {
    match param.group.comm().device_collectives() {
        Some(nccl) => {
            let client = tensor.client.clone();
            let tensor = client.resolve_tensor_float::<CubeBackend>(tensor);
            register(&client, on_gpus(nccl, tensor, param))
        }
        None => on_host(tensor, param),
    }
}
