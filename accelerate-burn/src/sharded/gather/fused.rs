//! The gather on Burn's fused GPU tensors, written out rather than generated: a generated
//! fused operation is lazy, run whenever the stream is flushed, and a collective must run
//! where the program calls it. The host path reads its tensor (which drains the stream) as on
//! any backend; NCCL's path resolves its tensor through the fusion client, runs on the cubecl
//! tensor underneath, and hands the result back to the stream.

use burn::backend::fusion::{Fusion, FusionTensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::fusion::FusionCubeRuntime;

use super::{GatherSpec, ShardOps, gather, on_gpus, reduce_scatter};
use crate::backend::fusion::register;

type Fused = FusionTensor<FusionCubeRuntime>;

impl ShardOps for Fusion<CubeBackend> {
    fn shard_anchor(input: Fused) -> Fused {
        input
    }

    fn shard_gather(shard: Fused, _: Fused, spec: GatherSpec) -> Fused {
        match spec.0.group.comm().device_collectives() {
            Some(nccl) => {
                let client = shard.client.clone();
                let shard = client.resolve_tensor_float::<CubeBackend>(shard);
                register(&client, on_gpus::gather(nccl, shard, &spec.0))
            }
            None => gather::<Self>(shard, &spec.0),
        }
    }

    fn shard_reduce_scatter(grad: Fused, spec: GatherSpec) -> Fused {
        match spec.0.group.comm().device_collectives() {
            Some(nccl) => {
                let client = grad.client.clone();
                let grad = client.resolve_tensor_float::<CubeBackend>(grad);
                register(&client, on_gpus::reduce_scatter(nccl, grad, &spec.0))
            }
            None => reduce_scatter::<Self>(grad, &spec.0),
        }
    }
}
