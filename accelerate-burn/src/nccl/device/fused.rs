//! NCCL on Burn's fused cuda tensors: each collective resolves its tensors through the fusion
//! client, runs on the cubecl tensors underneath, and hands its output back to the fusion
//! stream as a new tensor.
//!
//! Ordering: resolving drains the tensor's fusion stream, so every queued operation that
//! writes the input has been handed to cubecl before the collective's `client.sync()` waits
//! for it; the output is registered after NCCL's stream is idle, so every later operation
//! reads finished values. Collectives are not lazy: they block, as on the unfused backend.

use burn::backend::fusion::{Fusion, FusionTensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::fusion::FusionCubeRuntime;

use super::{GpuError, NcclCall, NcclKernels};
use crate::backend::fusion::register;

type Fused = FusionTensor<FusionCubeRuntime>;

impl NcclKernels for Fusion<CubeBackend> {
    fn nccl_all_reduce(values: Fused, call: NcclCall) -> (Fused, Result<(), GpuError>) {
        let client = values.client.clone();
        // Resolved read-write when this is the tensor's only reference (as after a `cat`), so
        // the reduction runs in place; otherwise the unfused path reduces a copy.
        let values = client.resolve_tensor_float::<CubeBackend>(values);
        let (values, result) = <CubeBackend as NcclKernels>::nccl_all_reduce(values, call);
        (register(&client, values), result)
    }

    fn nccl_collective(
        input: Fused,
        output: Fused,
        call: NcclCall,
    ) -> (Fused, Result<(), GpuError>) {
        let client = output.client.clone();
        let input = client.resolve_tensor_float::<CubeBackend>(input);
        let output = client.resolve_tensor_float::<CubeBackend>(output);
        let (output, result) = <CubeBackend as NcclKernels>::nccl_collective(input, output, call);
        (register(&client, output), result)
    }
}
