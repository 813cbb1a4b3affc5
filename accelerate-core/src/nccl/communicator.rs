//! One NCCL communicator, created non-blocking so that nothing NCCL does can hang a job: every
//! wait is a poll with a deadline, and a deadline passed aborts the communicator and returns
//! an error naming this rank, instead of NCCL's indefinite wait.

// FFI into libnccl (and `dladdr`): the only unsafe code of the NCCL path besides the
// reducer's device pointers; each call says why it is sound.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::NcclError;
use super::library::{
    Api, CONFIG_MAGIC, CONFIG_UNDEF_INT, ConfigPrefix, NCCL_IN_PROGRESS, NCCL_SUCCESS, NcclLibrary,
    UniqueId,
};

/// How often a wait looks at the communicator and the stream again.
const POLL: Duration = Duration::from_micros(50);

/// NCCL's element types we send (`ncclDataType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum NcclDataType {
    /// `ncclFloat16`.
    F16 = 6,
    /// `ncclFloat32`.
    F32 = 7,
    /// `ncclBfloat16`.
    Bf16 = 9,
}

impl NcclDataType {
    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            Self::F16 | Self::Bf16 => 2,
            Self::F32 => 4,
        }
    }
}

/// NCCL's reductions we use (`ncclRedOp_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum NcclOp {
    /// `ncclSum`.
    Sum = 0,
    /// `ncclMax`.
    Max = 2,
    /// `ncclMin`.
    Min = 3,
    /// `ncclAvg` (NCCL 2.10 and later): the sum divided by the world size, in one pass
    /// (floating-point inputs are scaled before they are summed).
    Avg = 4,
}

impl From<crate::comm::Reduction> for NcclOp {
    fn from(reduction: crate::comm::Reduction) -> Self {
        use crate::comm::Reduction;
        match reduction {
            Reduction::Sum => Self::Sum,
            Reduction::Mean => Self::Avg,
            Reduction::Max => Self::Max,
            Reduction::Min => Self::Min,
        }
    }
}

/// A communicator of one process group on this process's GPU.
pub struct NcclCommunicator {
    library: Arc<NcclLibrary>,
    comm: *mut c_void,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Set once aborted: the handle is gone and every later call is refused.
    aborted: bool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `NcclCommunicator` needs `&mut self` for every call that enqueues or aborts.
unsafe impl Send for NcclCommunicator {}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("aborted", &self.aborted)
            .finish_non_exhaustive()
    }
}

impl NcclCommunicator {
    /// Joins the communicator `id` names as `rank` of `world` on the current CUDA device (the
    /// caller made it current). Non-blocking: initialisation is polled until `timeout`, then
    /// aborted (a rank that never joins cannot hang the others' start).
    pub fn join(
        library: Arc<NcclLibrary>,
        id: &UniqueId,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self, NcclError> {
        let mut config = ConfigPrefix {
            size: std::mem::size_of::<ConfigPrefix>(),
            magic: CONFIG_MAGIC,
            version: library.version().code(),
            blocking: 0,
            cga_cluster_size: CONFIG_UNDEF_INT,
        };
        let mut comm: *mut c_void = std::ptr::null_mut();
        // SAFETY: `comm` receives the handle, `config` is a valid prefix of ncclConfig_t for
        // the duration of the call, ranks were checked by the process group.
        let rc = unsafe {
            (library.api.comm_init_rank_config)(
                &mut comm,
                world as c_int,
                id.raw(),
                rank as c_int,
                &mut config,
            )
        };
        if rc != NCCL_SUCCESS && rc != NCCL_IN_PROGRESS {
            if !comm.is_null() {
                // SAFETY: a handle NCCL returned, released once.
                unsafe { (library.api.comm_abort)(comm) };
            }
            library.check("ncclCommInitRankConfig", rc)?;
        }
        let mut communicator = Self {
            library,
            comm,
            rank,
            world,
            timeout,
            aborted: false,
        };
        communicator.wait_for("joining the communicator", || Ok::<_, NcclError>(true))?;
        Ok(communicator)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The communicator's state: `Ok(true)` idle, `Ok(false)` still working on a
    /// non-blocking call, an error when NCCL failed (a peer's failure included).
    fn poll(&self) -> Result<bool, NcclError> {
        if self.aborted {
            return Err(self.aborted_error());
        }
        let mut state: c_int = NCCL_SUCCESS;
        // SAFETY: a live communicator; writes one int.
        let rc = unsafe { (self.library.api.comm_get_async_error)(self.comm, &mut state) };
        self.library.check("ncclCommGetAsyncError", rc)?;
        match state {
            NCCL_SUCCESS => Ok(true),
            NCCL_IN_PROGRESS => Ok(false),
            code => self
                .library
                .check("a collective on this communicator", code)
                .map(|_| true),
        }
    }

    /// Waits until the communicator is idle and `done` says the work is complete (the caller
    /// queries its CUDA stream); past the timeout, or when NCCL reports an error, aborts the
    /// communicator and returns an error naming this rank and `what`.
    pub fn wait_for<E: std::fmt::Display>(
        &mut self,
        what: &'static str,
        mut done: impl FnMut() -> Result<bool, E>,
    ) -> Result<(), NcclError> {
        let start = Instant::now();
        loop {
            let idle = match self.poll() {
                Ok(idle) => idle,
                Err(e) => {
                    self.abort();
                    return Err(NcclError::Failed {
                        rank: self.rank,
                        what,
                        reason: e.to_string(),
                    });
                }
            };
            if idle {
                match done() {
                    Ok(true) => return Ok(()),
                    Ok(false) => {}
                    Err(reason) => {
                        self.abort();
                        return Err(NcclError::Failed {
                            rank: self.rank,
                            what,
                            reason: reason.to_string(),
                        });
                    }
                }
            }
            if start.elapsed() >= self.timeout {
                self.abort();
                return Err(NcclError::Timeout {
                    rank: self.rank,
                    what,
                    seconds: self.timeout.as_secs_f64(),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// Enqueues an all-reduce of `count` elements from `send` into `recv` (the same pointer
    /// for in place) on `stream`.
    ///
    /// # Safety
    /// `send` and `recv` are device allocations of at least `count` elements of `dtype` on
    /// this communicator's GPU, not written by anything else until the caller's wait returns;
    /// `stream` is a CUDA stream of that GPU.
    pub unsafe fn all_reduce(
        &mut self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: NcclDataType,
        op: NcclOp,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        // SAFETY: forwarded to the caller.
        self.enqueue("ncclAllReduce", |api, comm| unsafe {
            (api.all_reduce)(send, recv, count, dtype as c_int, op as c_int, comm, stream)
        })
    }

    /// Enqueues a reduce-scatter: `recv` gets this rank's `recv_count` elements of the
    /// reduction of every rank's `send` (`recv_count * world` elements).
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce), with `send` holding `recv_count * world` elements.
    pub unsafe fn reduce_scatter(
        &mut self,
        send: *const c_void,
        recv: *mut c_void,
        recv_count: usize,
        dtype: NcclDataType,
        op: NcclOp,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        // SAFETY: forwarded to the caller.
        self.enqueue("ncclReduceScatter", |api, comm| unsafe {
            (api.reduce_scatter)(
                send,
                recv,
                recv_count,
                dtype as c_int,
                op as c_int,
                comm,
                stream,
            )
        })
    }

    /// Enqueues an all-gather: `recv` gets every rank's `send_count` elements, in rank order.
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce), with `recv` holding `send_count * world` elements.
    pub unsafe fn all_gather(
        &mut self,
        send: *const c_void,
        recv: *mut c_void,
        send_count: usize,
        dtype: NcclDataType,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        // SAFETY: forwarded to the caller.
        self.enqueue("ncclAllGather", |api, comm| unsafe {
            (api.all_gather)(send, recv, send_count, dtype as c_int, comm, stream)
        })
    }

    /// Makes one enqueueing call (`call` gets the functions and the communicator) on a
    /// communicator that was not aborted. A non-blocking call returns `ncclInProgress` while
    /// it is still being enqueued; any other failure aborts the communicator.
    fn enqueue(
        &mut self,
        function: &'static str,
        call: impl FnOnce(&Api, *mut c_void) -> c_int,
    ) -> Result<(), NcclError> {
        if self.aborted {
            return Err(self.aborted_error());
        }
        let rc = call(&self.library.api, self.comm);
        if rc == NCCL_SUCCESS || rc == NCCL_IN_PROGRESS {
            return Ok(());
        }
        let error = self.library.check(function, rc).err();
        self.abort();
        Err(NcclError::Failed {
            rank: self.rank,
            what: function,
            reason: error.map_or_else(String::new, |e| e.to_string()),
        })
    }

    /// Aborts the communicator: NCCL's kernels of it stop and its resources are released.
    /// Every later call is an error.
    pub fn abort(&mut self) {
        if !self.aborted && !self.comm.is_null() {
            // SAFETY: a live communicator, released once.
            unsafe { (self.library.api.comm_abort)(self.comm) };
        }
        self.aborted = true;
    }

    fn aborted_error(&self) -> NcclError {
        NcclError::Failed {
            rank: self.rank,
            what: "using the communicator",
            reason: "it was aborted after an earlier failure".into(),
        }
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        if self.aborted || self.comm.is_null() {
            return;
        }
        // A clean destroy waits for outstanding work; only an idle communicator gets one, so
        // that dropping never hangs.
        if matches!(self.poll(), Ok(true)) {
            // SAFETY: a live, idle communicator, released once.
            unsafe { (self.library.api.comm_destroy)(self.comm) };
        } else {
            // SAFETY: as above.
            unsafe { (self.library.api.comm_abort)(self.comm) };
        }
    }
}
