//! The `nccl` build's half: one communicator and one CUDA stream per process, and NCCL's
//! collectives on Burn's cuda tensors through a backend extension (the only way to reach a
//! cubecl buffer's device address).
//!
//! Ordering: the tensors' producers are waited for (`client.sync()`, this thread's cubecl
//! stream), NCCL runs on our own stream, and the call returns once that stream is idle, polled
//! with a deadline, so a later kernel reads finished values and a lost peer is an error after
//! the collective timeout instead of a hang. Events between cubecl's stream and ours would
//! save the first wait; cubecl 0.11 does not expose its stream handles.

// Raw CUDA handles and device addresses: the NCCL path's unsafe code, each block says why
// it is sound.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use accelerate_core::comm::{ProcessGroup, Reduction};
use accelerate_core::nccl::{self, NcclCommunicator, NcclDataType, NcclLibrary, NcclOp};
use accelerate_core::state::ProcessEnv;
use accelerate_core::{MixedPrecision, NcclMode};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};
use cubecl_runtime::server::ServerError;
use cudarc::driver::{result as cu, sys};

use super::DeviceCollectives;
use crate::error::AccelerateError;

/// What failed on this process's GPU in the NCCL path; the collective's caller wraps it with
/// the rank ([`AccelerateError::Tensor`]).
#[derive(Debug, thiserror::Error)]
pub(crate) enum GpuError {
    /// A CUDA driver call failed.
    #[error("{call}: {source}")]
    Driver {
        /// The call, with its argument where one tells which (`CUDA device 1`).
        call: String,
        /// What the driver said.
        source: cu::DriverError,
    },
    /// The local rank does not fit CUDA's device ordinal.
    #[error("local rank {0} is not a CUDA device ordinal")]
    Ordinal(usize),
    /// libnccl did not load, or NCCL failed or timed out.
    #[error(transparent)]
    Nccl(#[from] nccl::NcclError),
    /// The buffers do not have the element counts the collective needs.
    #[error("{kind:?} of {count} elements per rank over {world} ranks needs {expected}, got {got}")]
    Counts {
        /// The collective.
        kind: CallKind,
        /// Elements per rank.
        count: usize,
        /// Ranks.
        world: usize,
        /// Elements the other buffer needs.
        expected: usize,
        /// Elements it has.
        got: usize,
    },
    /// NCCL's stream reported an error while we waited on it.
    #[error("the NCCL stream failed: {0:?}")]
    Stream(sys::CUresult),
    /// A buffer is a strided view; NCCL reads and writes dense ranges.
    #[error("NCCL needs contiguous buffers")]
    NotContiguous,
    /// The buffers' dtype is not the collective's.
    #[error("NCCL was asked for {wanted:?} elements, the buffers hold {input:?} and {output:?}")]
    DType {
        /// The collective's dtype.
        wanted: DType,
        /// The input buffer's.
        input: DType,
        /// The output buffer's.
        output: DType,
    },
    /// Waiting for the kernels that produce the input failed.
    #[error("waiting for the kernels before NCCL: {0}")]
    Sync(ServerError),
    /// The tensor's buffer is not cubecl-cuda's.
    #[error("not a CUDA buffer: {0}")]
    NotCuda(ServerError),
}

/// A failed driver `call`, as a [`GpuError`].
fn driver(call: impl Into<String>) -> impl FnOnce(cu::DriverError) -> GpuError {
    let call = call.into();
    move |source| GpuError::Driver { call, source }
}

/// One process's NCCL: its communicator, the CUDA context of its GPU and the stream NCCL runs
/// on.
pub(crate) struct DeviceNccl {
    // First: the communicator is destroyed before its stream.
    comm: NcclCommunicator,
    context: sys::CUcontext,
    stream: OwnedStream,
}

/// A CUDA stream of ours, destroyed when dropped.
struct OwnedStream(sys::CUstream);

impl Drop for OwnedStream {
    fn drop(&mut self) {
        // SAFETY: a stream we created and nobody else holds; an error here (a context already
        // torn down at exit) leaves nothing to clean.
        let _ = unsafe { cu::stream::destroy(self.0) };
    }
}

// SAFETY: the context and stream are plain CUDA handles, valid on any thread that makes the
// context current (every call does); the mutex around `DeviceNccl` serialises their use.
unsafe impl Send for DeviceNccl {}

/// The GPU of `ordinal`: its primary context (the one cubecl allocates in), made current on
/// this thread, and a non-blocking stream for NCCL.
fn open_device(local_rank: usize) -> Result<(sys::CUcontext, OwnedStream), GpuError> {
    let ordinal = i32::try_from(local_rank).map_err(|_| GpuError::Ordinal(local_rank))?;
    cu::init().map_err(driver("cuInit"))?;
    let device = cu::device::get(ordinal).map_err(driver(format!("CUDA device {ordinal}")))?;
    // SAFETY: `device` came from `device::get`; the context is retained for the process.
    let context = unsafe { cu::primary_ctx::retain(device) }
        .map_err(driver(format!("primary context of device {ordinal}")))?;
    // SAFETY: a context just retained.
    unsafe { cu::ctx::set_current(context) }.map_err(driver("cuCtxSetCurrent"))?;
    let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
        .map_err(driver("cuStreamCreate"))?;
    Ok((context, OwnedStream(stream)))
}

impl DeviceCollectives {
    /// Agrees with every rank (libnccl loaded everywhere, rank 0's id handed out, every GPU
    /// opened), then joins the communicator. `None`: the job takes the host path.
    pub(super) fn join(
        group: &mut ProcessGroup,
        mode: NcclMode,
        local_rank: usize,
        timeout: Duration,
    ) -> Result<Option<Self>, AccelerateError> {
        let (rank, world) = (group.rank(), group.world_size());
        // This rank can take part when libnccl loads and its GPU opens; every rank says so
        // before any joins, so that one rank's failure is a decision on all of them now rather
        // than a communicator the others wait for.
        let local = NcclLibrary::find(&ProcessEnv)
            .map_err(GpuError::from)
            .and_then(|library| Ok((Arc::new(library), open_device(local_rank)?)));
        let id = nccl::agree(group, mode, local.as_ref().map(|(l, _)| l.as_ref()))?;
        let (Some(id), Ok((library, (context, stream)))) = (id, local) else {
            return Ok(None);
        };
        let comm = NcclCommunicator::join(library, &id, rank, world, timeout)?;
        if rank == 0 {
            tracing::info!(world, "gradients are averaged on the GPUs with NCCL");
        }
        Ok(Some(Self(Arc::new(Mutex::new(DeviceNccl {
            comm,
            context,
            stream,
        })))))
    }

    /// The mean of `values` over the ranks, on the device (in place when no other tensor
    /// shares its buffer, as after a `cat`), travelling in `wire` precision.
    pub fn all_reduce_mean(
        &self,
        values: Tensor<1>,
        wire: MixedPrecision,
    ) -> Result<Tensor<1>, AccelerateError> {
        self.all_reduce(values, Reduction::Mean, wire)
    }

    /// `values` reduced over the ranks by `reduction` on the device, travelling in `wire`
    /// precision; f32 comes back.
    pub fn all_reduce(
        &self,
        values: Tensor<1>,
        reduction: Reduction,
        wire: MixedPrecision,
    ) -> Result<Tensor<1>, AccelerateError> {
        let (values, dtype) = on_wire(values, wire);
        let call = self.call(CallKind::AllReduce(reduction.into()), dtype);
        let rank = call.lock().comm.rank();
        let (out, result) =
            <Dispatch as NcclKernels>::nccl_all_reduce(values.into_dispatch(), call);
        checked(rank, result)?;
        Ok(Tensor::<1>::from_dispatch(out).cast(DType::F32))
    }

    /// This rank's `shard_len` elements of the mean of `values` (`shard_len * world` of them)
    /// over the ranks.
    pub fn reduce_scatter_mean(
        &self,
        values: Tensor<1>,
        shard_len: usize,
        wire: MixedPrecision,
    ) -> Result<Tensor<1>, AccelerateError> {
        let (values, dtype) = on_wire(values, wire);
        let shard = Tensor::<1>::zeros([shard_len], &values.device()).cast(values.dtype());
        let call = self.call(CallKind::ReduceScatterMean, dtype);
        Ok(collective(values, shard, call)?.cast(DType::F32))
    }

    /// Every rank's `shard` (f32, the same length on all), concatenated in rank order.
    pub fn all_gather(&self, shard: Tensor<1>) -> Result<Tensor<1>, AccelerateError> {
        let world = self.lock().comm.world_size();
        let len = shard.shape().num_elements() * world;
        let out = Tensor::<1>::zeros([len], &shard.device());
        collective(
            shard,
            out,
            self.call(CallKind::AllGather, NcclDataType::F32),
        )
    }

    fn call(&self, kind: CallKind, dtype: NcclDataType) -> NcclCall {
        NcclCall {
            nccl: Arc::clone(&self.0),
            kind,
            dtype,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, DeviceNccl> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `values` in the precision gradients travel in, and NCCL's name for it. A cast is a new
/// buffer, so the half-precision wire never writes into the caller's tensor.
fn on_wire(values: Tensor<1>, wire: MixedPrecision) -> (Tensor<1>, NcclDataType) {
    match wire {
        MixedPrecision::No => (values.cast(DType::F32), NcclDataType::F32),
        MixedPrecision::Bf16 => (values.cast(DType::BF16), NcclDataType::Bf16),
        MixedPrecision::Fp16 => (values.cast(DType::F16), NcclDataType::F16),
    }
}

/// Runs `call` from `input` into `output` on the device.
fn collective(
    input: Tensor<1>,
    output: Tensor<1>,
    call: NcclCall,
) -> Result<Tensor<1>, AccelerateError> {
    let rank = call.lock().comm.rank();
    let (out, result) = <Dispatch as NcclKernels>::nccl_collective(
        input.into_dispatch(),
        output.into_dispatch(),
        call,
    );
    checked(rank, result)?;
    Ok(Tensor::from_dispatch(out))
}

fn checked(rank: usize, result: Result<(), GpuError>) -> Result<(), AccelerateError> {
    result.map_err(|e| AccelerateError::Tensor {
        rank,
        op: "a collective on the GPUs with NCCL",
        detail: e.to_string(),
    })
}

/// Which collective.
#[derive(Debug, Clone, Copy)]
pub(crate) enum CallKind {
    /// In place, reduced by the operation.
    AllReduce(NcclOp),
    /// Into this rank's shard, averaged.
    ReduceScatterMean,
    /// Every rank's input, in rank order.
    AllGather,
}

/// One collective for the backend extension to run.
#[derive(Clone)]
pub(crate) struct NcclCall {
    nccl: Arc<Mutex<DeviceNccl>>,
    kind: CallKind,
    dtype: NcclDataType,
}

impl NcclCall {
    fn lock(&self) -> std::sync::MutexGuard<'_, DeviceNccl> {
        self.nccl.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Enqueues the collective between device addresses `input` and `output` (elements:
    /// `input_len`, `output_len`) and waits for it.
    fn run(
        &self,
        input: u64,
        output: u64,
        input_len: usize,
        output_len: usize,
    ) -> Result<(), GpuError> {
        let mut nccl = self.lock();
        let world = nccl.comm.world_size();
        let (count, expected) = match self.kind {
            CallKind::AllReduce(_) => (input_len, input_len),
            CallKind::ReduceScatterMean => (output_len, output_len * world),
            CallKind::AllGather => (input_len, input_len * world),
        };
        let other = match self.kind {
            CallKind::ReduceScatterMean => input_len,
            _ => output_len,
        };
        if other != expected {
            return Err(GpuError::Counts {
                kind: self.kind,
                count,
                world,
                expected,
                got: other,
            });
        }
        // SAFETY: the context is the GPU's primary context, retained for the process.
        unsafe { cu::ctx::set_current(nccl.context) }.map_err(driver("cuCtxSetCurrent"))?;
        let stream = nccl.stream.0;
        let (send, recv) = (input as *const c_void, output as *mut c_void);
        // SAFETY: `input` and `output` are live cubecl allocations on this GPU of at least
        // the counts checked above, held (ManagedResource) by the caller until this returns,
        // and nothing else writes them meanwhile (their producers have finished; their
        // readers come after); `stream` belongs to this context.
        let enqueued = unsafe {
            match self.kind {
                CallKind::AllReduce(op) => {
                    nccl.comm
                        .all_reduce(send, recv, count, self.dtype, op, stream.cast())
                }
                CallKind::ReduceScatterMean => nccl.comm.reduce_scatter(
                    send,
                    recv,
                    count,
                    self.dtype,
                    NcclOp::Avg,
                    stream.cast(),
                ),
                CallKind::AllGather => {
                    nccl.comm
                        .all_gather(send, recv, count, self.dtype, stream.cast())
                }
            }
        };
        enqueued?;
        nccl.comm.wait_for("a gradient collective", || {
            // SAFETY: a stream of the current context.
            match unsafe { sys::cuStreamQuery(stream) } {
                sys::CUresult::CUDA_SUCCESS => Ok(true),
                sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                other => Err(GpuError::Stream(other)),
            }
        })?;
        Ok(())
    }
}

/// NCCL on Burn's cubecl tensors. Only the cuda runtime answers; another cubecl runtime gets
/// an error (its server is not CUDA's).
#[backend_extension(Cube: cfg(feature = "nccl"))]
pub(crate) trait NcclKernels: Backend {
    /// Runs the all-reduce `call` on `values`, in place when no other tensor shares them (else
    /// on a copy), and returns them, with the outcome.
    fn nccl_all_reduce(
        values: FloatTensor<Self>,
        call: NcclCall,
    ) -> (FloatTensor<Self>, Result<(), GpuError>);

    /// Runs `call` (a reduce-scatter or all-gather) from `input` into `output` and returns
    /// `output`, with the outcome.
    fn nccl_collective(
        input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        call: NcclCall,
    ) -> (FloatTensor<Self>, Result<(), GpuError>);
}

#[cfg(feature = "fusion")]
mod fused;
mod shards;

mod cube {
    use burn_cubecl::CubeBackend;
    use burn_cubecl::tensor::CubeTensor;

    use burn::tensor::DType;

    use super::{GpuError, NcclCall, NcclDataType, NcclKernels};

    type CudaServer = <cubecl::cuda::CudaRuntime as cubecl_runtime::runtime::Runtime>::Server;

    impl NcclKernels for CubeBackend {
        fn nccl_all_reduce(
            values: CubeTensor,
            call: NcclCall,
        ) -> (CubeTensor, Result<(), GpuError>) {
            let values = if values.is_contiguous() && values.can_mut() {
                values
            } else {
                // Another tensor reads this buffer (or a view of it): reduce a copy.
                burn_cubecl::kernel::into_contiguous(values).copy()
            };
            let result = run(&values, &values, &call);
            (values, result)
        }

        fn nccl_collective(
            input: CubeTensor,
            output: CubeTensor,
            call: NcclCall,
        ) -> (CubeTensor, Result<(), GpuError>) {
            let result = run(&input, &output, &call);
            (output, result)
        }
    }

    fn run(input: &CubeTensor, output: &CubeTensor, call: &NcclCall) -> Result<(), GpuError> {
        if !input.is_contiguous() || !output.is_contiguous() {
            return Err(GpuError::NotContiguous);
        }
        // NCCL reads and writes `count` elements of the call's type: buffers of a wider type
        // than they hold would be overrun.
        let wanted = match call.dtype {
            NcclDataType::F32 => DType::F32,
            NcclDataType::F16 => DType::F16,
            NcclDataType::Bf16 => DType::BF16,
        };
        if input.dtype != wanted || output.dtype != wanted {
            return Err(GpuError::DType {
                wanted,
                input: input.dtype,
                output: output.dtype,
            });
        }
        let client = &input.client;
        // The kernels that wrote the input (and zeroed the output) have finished.
        cubecl::future::block_on(client.sync()).map_err(GpuError::Sync)?;
        let src = client
            .get_resource::<CudaServer>(input.handle.clone())
            .map_err(GpuError::NotCuda)?;
        let dst = client
            .get_resource::<CudaServer>(output.handle.clone())
            .map_err(GpuError::NotCuda)?;
        // `src` and `dst` keep both allocations in place until the collective is done.
        call.run(
            src.resource().ptr,
            dst.resource().ptr,
            input.meta.shape().num_elements(),
            output.meta.shape().num_elements(),
        )
    }
}
