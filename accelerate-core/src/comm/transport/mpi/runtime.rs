//! Every call into the MPI library, kept in this one file: initialisation (once per process),
//! the end of the process (finalise after a clean exit, abort the whole job after a failed one),
//! the communicators and the reduction operations on halves the engine uses, and the
//! collectives themselves. Everything else in the engine is safe Rust over these wrappers.
//!
//! Handles (`MPI_Comm`, `MPI_Datatype`, `MPI_Op`) are pointers in Open MPI; they are only
//! used while MPI is initialised, which lasts until the process exits.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use accelerate_kernels::{DType, ReduceOp};
use mpi::ffi;

use crate::error::CommError;

unsafe extern "C" {
    /// `MPI_IN_PLACE` of the MPI library we were built against (shim.c).
    safe fn accelerate_mpi_in_place() -> *mut c_void;
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
unsafe extern "C" {
    /// glibc's `on_exit`: like `atexit`, with the exit status.
    fn on_exit(function: extern "C" fn(c_int, *mut c_void), arg: *mut c_void) -> c_int;
}

/// Whether this process initialised MPI (and so must finalise it), once known; or the error
/// code `MPI_Init_thread` returned.
static OURS: OnceLock<Result<bool, c_int>> = OnceLock::new();
/// Set when a group of this process failed: its exit then aborts the job even with status 0
/// (a peer may be waiting for a call this rank will never make).
static FAILED: AtomicBool = AtomicBool::new(false);

/// Runs `f` with room for a handle that MPI fills in (handles are pointers in Open MPI and
/// integers in MPICH, so none is made up here): the handle once `f` returned `MPI_SUCCESS`.
fn filled<T>(f: impl FnOnce(*mut T) -> c_int) -> Result<T, c_int> {
    let mut handle = std::mem::MaybeUninit::<T>::uninit();
    match f(handle.as_mut_ptr()) {
        // SAFETY: MPI wrote the handle (it returned success).
        0 => Ok(unsafe { handle.assume_init() }),
        code => Err(code),
    }
}

/// MPI's description of error `code`.
fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: MPI writes at most MPI_MAX_ERROR_STRING (256 in Open MPI and MPICH) bytes.
    let described = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) } == 0;
    if !described {
        return format!("MPI error {code}");
    }
    buf.truncate(usize::try_from(len).unwrap_or(0).min(512));
    String::from_utf8_lossy(&buf).into_owned()
}

/// `Ok` for `MPI_SUCCESS`, else the error of `call` on `rank`.
fn check(code: c_int, call: &dyn std::fmt::Display, rank: usize) -> Result<(), CommError> {
    match code {
        0 => Ok(()),
        code => Err(failure(code, call, rank)),
    }
}

/// Error `code` of `call` on `rank`, in MPI's words.
fn failure(code: c_int, call: &dyn std::fmt::Display, rank: usize) -> CommError {
    let mut detail = error_string(code);
    if detail.contains("truncat") {
        detail.push_str(
            ". hint: ranks called collectives of different sizes; every rank must make the same \
             calls with the same sizes in the same order",
        );
    }
    CommError::Mpi {
        call: call.to_string(),
        rank,
        detail,
    }
}

/// Initialises MPI once per process, or adopts the caller's MPI if it already did, and
/// registers the exit hook that finalises or aborts.
///
/// The level asked for is `MPI_THREAD_SINGLE`, what `MPI_Init` gives a C program: in Open MPI
/// 4.1 every higher level slows small calls (a 4 KiB all-reduce between 2 local ranks, median
/// of 12 interleaved runs: 1.49 us single, 1.85 serialized, against 1.40 for a C program).
/// The engine is driven by one thread at a time, which Open MPI and MPICH allow at this level
/// whichever thread it is; the watchdog's `MPI_Abort` from its own thread is the one exception,
/// made only to end the job. A program that needs more calls `MPI_Init_thread` itself before
/// the group forms: the engine then adopts its MPI as it is.
pub fn init(rank: usize) -> Result<(), CommError> {
    let ours = OURS.get_or_init(|| {
        let mut initialized: c_int = 0;
        // SAFETY: MPI_Initialized may be called at any time.
        unsafe { ffi::MPI_Initialized(&mut initialized) };
        if initialized != 0 {
            return Ok(false);
        }
        let mut provided: c_int = 0;
        // SAFETY: no arguments (allowed since MPI-2); called once (OnceLock); the level is the
        // library's constant.
        let code = unsafe {
            ffi::MPI_Init_thread(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                ffi::RSMPI_THREAD_SINGLE,
                &mut provided,
            )
        };
        if code != 0 {
            return Err(code);
        }
        register_exit_hook();
        Ok(true)
    });
    match ours {
        Ok(_) => Ok(()),
        Err(code) => Err(CommError::Mpi {
            call: "MPI_Init_thread".into(),
            rank,
            detail: format!(
                "{}. hint: start the job with mpirun (or srun --mpi=pmix), or use \
                 ACCELERATE_TRANSPORT=auto",
                error_string(*code)
            ),
        }),
    }
}

/// Records that a group failed: the process's exit then aborts the job.
pub fn mark_failed() {
    FAILED.store(true, Ordering::SeqCst);
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn register_exit_hook() {
    // SAFETY: registers a function with no captured state.
    unsafe { on_exit(exit_hook, std::ptr::null_mut()) };
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn register_exit_hook() {
    extern "C" fn at_exit() {
        exit_hook(0, std::ptr::null_mut());
    }
    // SAFETY: as above.
    unsafe { nix::libc::atexit(at_exit) };
}

/// At exit: a clean end finalises MPI (which waits for the other ranks to finish); a failed
/// one (non-zero status, or a failed group) aborts the whole job at once, so no peer waits for
/// this rank, and the launcher reports which rank ended it.
extern "C" fn exit_hook(status: c_int, _arg: *mut c_void) {
    let mut finalized: c_int = 0;
    // SAFETY: MPI_Finalized may be called at any time.
    unsafe { ffi::MPI_Finalized(&mut finalized) };
    if finalized != 0 {
        return;
    }
    if status != 0 || FAILED.load(Ordering::SeqCst) {
        abort(status.max(1));
    }
    // SAFETY: MPI is initialised (we did it) and not finalised.
    unsafe { ffi::MPI_Finalize() };
}

/// Ends every process of the job (`MPI_Abort` on `MPI_COMM_WORLD`).
pub fn abort(code: c_int) -> ! {
    // SAFETY: callable from any thread once MPI is initialised; it does not return in Open MPI
    // or MPICH, and if it did, this process ends anyway.
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code) };
    std::process::abort()
}

/// A reduction MPI calls back: `inout = f(inout, input)` over `len` elements of `datatype`.
type Callback = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_int, *mut ffi::MPI_Datatype);

/// Wraps a safe `f(inout, input)` on whole byte buffers into MPI's calling convention.
macro_rules! callback {
    ($name:ident, $f:expr) => {
        unsafe extern "C" fn $name(
            input: *mut c_void,
            inout: *mut c_void,
            len: *mut c_int,
            datatype: *mut ffi::MPI_Datatype,
        ) {
            let mut size: c_int = 0;
            // SAFETY: MPI passes valid pointers to `len` and `datatype`, and two distinct
            // buffers of `len` elements of `datatype`.
            let (input, inout) = unsafe {
                ffi::MPI_Type_size(*datatype, &mut size);
                let bytes = usize::try_from(size)
                    .unwrap_or(0)
                    .saturating_mul(usize::try_from(*len).unwrap_or(0));
                // MPI may pass null buffers for zero elements, and a slice may never be built
                // from a null pointer, even an empty one.
                if bytes == 0 || input.is_null() || inout.is_null() {
                    return;
                }
                (
                    std::slice::from_raw_parts(input.cast::<u8>().cast_const(), bytes),
                    std::slice::from_raw_parts_mut(inout.cast::<u8>(), bytes),
                )
            };
            let f: fn(&mut [u8], &[u8]) = $f;
            f(inout, input);
        }
    };
}

callback!(f16_sum, |a, b| half(DType::F16, ReduceOp::Sum, a, b));
callback!(f16_max, |a, b| half(DType::F16, ReduceOp::Max, a, b));
callback!(f16_min, |a, b| half(DType::F16, ReduceOp::Min, a, b));
callback!(bf16_sum, |a, b| half(DType::BF16, ReduceOp::Sum, a, b));
callback!(bf16_max, |a, b| half(DType::BF16, ReduceOp::Max, a, b));
callback!(bf16_min, |a, b| half(DType::BF16, ReduceOp::Min, a, b));

/// Reduces halves of `dtype` (nothing on a partial element: MPI hands whole ones).
fn half(dtype: DType, op: ReduceOp, inout: &mut [u8], input: &[u8]) {
    let len = inout.len().min(input.len());
    if len.is_multiple_of(dtype.size()) {
        accelerate_kernels::reduce::reduce_bytes(dtype, op, &mut inout[..len], &input[..len]);
    }
}

/// The operations the engine creates once per process.
struct Ops {
    /// f16 then bf16, each sum, max, min.
    halves: [ffi::MPI_Op; 6],
}

// SAFETY: operation handles are immutable once created and valid until MPI_Finalize.
unsafe impl Send for Ops {}
// SAFETY: as above.
unsafe impl Sync for Ops {}

static OPS: OnceLock<Option<Ops>> = OnceLock::new();

fn create_op(function: Callback) -> Option<ffi::MPI_Op> {
    // SAFETY: the callback is commutative and associative (min/max/sum), never panics on any
    // input, and MPI is initialised (callers hold a `Comm`).
    filled(|op| unsafe { ffi::MPI_Op_create(Some(function), 1, op) }).ok()
}

/// The operations, created at the first use; `None` if MPI refused to create one.
fn ops() -> Option<&'static Ops> {
    OPS.get_or_init(|| {
        let halves = [f16_sum, f16_max, f16_min, bf16_sum, bf16_max, bf16_min].map(create_op);
        Some(Ops {
            halves: [
                halves[0]?, halves[1]?, halves[2]?, halves[3]?, halves[4]?, halves[5]?,
            ],
        })
    })
    .as_ref()
}

/// How MPI reduces elements of `dtype` with `op`: a predefined operation on `MPI_FLOAT`, or
/// ours on `MPI_UINT16_T` for halves (widened to f32 per element, rounded once per
/// combination, as on our own transports).
fn element_op(dtype: DType, op: ReduceOp, ops: &Ops) -> (ffi::MPI_Datatype, ffi::MPI_Op) {
    let index = match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
    };
    // SAFETY: reading the library's predefined handles.
    unsafe {
        match dtype {
            DType::F32 => (
                ffi::RSMPI_FLOAT,
                [ffi::RSMPI_SUM, ffi::RSMPI_MAX, ffi::RSMPI_MIN][index],
            ),
            DType::F16 => (ffi::RSMPI_UINT16_T, ops.halves[index]),
            DType::BF16 => (ffi::RSMPI_UINT16_T, ops.halves[3 + index]),
        }
    }
}

/// Largest count passed to one MPI call (counts are C ints); longer buffers go in pieces.
pub const MAX_COUNT: usize = 1 << 30;

fn count(n: usize) -> c_int {
    c_int::try_from(n).unwrap_or(c_int::MAX)
}

/// A communicator of ours (a duplicate of `MPI_COMM_WORLD`, or a part of one), whose errors
/// come back as codes instead of ending the process.
pub struct Comm {
    raw: ffi::MPI_Comm,
    rank: usize,
    ops: &'static Ops,
}

// SAFETY: a `Comm` is used by one thread at a time (`&mut self`), which MPI allows at every
// thread level in practice (see `init`).
unsafe impl Send for Comm {}

impl Comm {
    /// A private duplicate of `MPI_COMM_WORLD`, so no other MPI user in the process can
    /// match our calls. `rank` names this process in errors.
    pub fn world(rank: usize) -> Result<Self, CommError> {
        // SAFETY: MPI is initialised (`init`); MPI fills in the new communicator.
        let raw = filled(|raw| unsafe { ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, raw) })
            .map_err(|code| failure(code, &"MPI_Comm_dup", rank))?;
        let ops = ops().ok_or_else(|| CommError::Mpi {
            call: "MPI_Op_create".into(),
            rank,
            detail: "MPI refused to create our reduction operations".into(),
        })?;
        Self::adopt(raw, rank, ops)
    }

    fn adopt(raw: ffi::MPI_Comm, rank: usize, ops: &'static Ops) -> Result<Self, CommError> {
        // SAFETY: `raw` is a valid communicator we own.
        let code = unsafe { ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN) };
        let comm = Self { raw, rank, ops };
        check(code, &"MPI_Comm_set_errhandler", rank)?;
        Ok(comm)
    }

    /// The ranks of this communicator that share this host's memory.
    pub fn this_host(&self) -> Result<Self, CommError> {
        // SAFETY: valid communicator; the key orders the new one like this one.
        let raw = filled(|raw| unsafe {
            ffi::MPI_Comm_split_type(
                self.raw,
                ffi::RSMPI_COMM_TYPE_SHARED,
                count(self.rank),
                ffi::RSMPI_INFO_NULL,
                raw,
            )
        })
        .map_err(|code| failure(code, &"MPI_Comm_split_type", self.rank))?;
        Self::adopt(raw, self.rank, self.ops)
    }

    /// (this process's rank, number of ranks) in this communicator.
    pub fn rank_and_size(&self) -> Result<(usize, usize), CommError> {
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: valid communicator.
        let code = unsafe {
            ffi::MPI_Comm_rank(self.raw, &mut rank) | ffi::MPI_Comm_size(self.raw, &mut size)
        };
        check(code, &"MPI_Comm_rank", self.rank)?;
        Ok((
            usize::try_from(rank).unwrap_or(0),
            usize::try_from(size).unwrap_or(0),
        ))
    }

    /// Reduces `buf` (elements of `dtype`) across ranks in place.
    pub fn all_reduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        call: &dyn std::fmt::Display,
    ) -> Result<(), CommError> {
        let (datatype, mpi_op) = element_op(dtype, op, self.ops);
        for piece in buf.chunks_mut(MAX_COUNT * dtype.size()) {
            // SAFETY: `piece` holds whole elements of `datatype` (same size as `dtype`).
            let code = unsafe {
                ffi::MPI_Allreduce(
                    accelerate_mpi_in_place(),
                    piece.as_mut_ptr().cast(),
                    count(piece.len() / dtype.size()),
                    datatype,
                    mpi_op,
                    self.raw,
                )
            };
            check(code, call, self.rank)?;
        }
        Ok(())
    }

    /// Copies `root`'s `buf` into every rank's.
    pub fn broadcast(
        &mut self,
        buf: &mut [u8],
        root: usize,
        call: &dyn std::fmt::Display,
    ) -> Result<(), CommError> {
        for piece in buf.chunks_mut(MAX_COUNT) {
            // SAFETY: `piece` is valid for `piece.len()` bytes.
            let code = unsafe {
                ffi::MPI_Bcast(
                    piece.as_mut_ptr().cast(),
                    count(piece.len()),
                    ffi::RSMPI_UINT8_T,
                    count(root),
                    self.raw,
                )
            };
            check(code, call, self.rank)?;
        }
        Ok(())
    }

    /// Every rank's `input`, in rank order, in `output`.
    pub fn all_gather(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        call: &dyn std::fmt::Display,
    ) -> Result<(), CommError> {
        if input.len() > MAX_COUNT {
            return Err(too_long(call, self.rank, input.len()));
        }
        // SAFETY: `output` holds world_size x `input.len()` bytes (checked by the group).
        let code = unsafe {
            ffi::MPI_Allgather(
                input.as_ptr().cast(),
                count(input.len()),
                ffi::RSMPI_UINT8_T,
                output.as_mut_ptr().cast(),
                count(input.len()),
                ffi::RSMPI_UINT8_T,
                self.raw,
            )
        };
        check(code, call, self.rank)
    }

    /// Reduces `input` across ranks and leaves rank `r` with `counts[r]` elements of the
    /// result (in rank order) in `output`.
    pub fn reduce_scatter(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
        call: &dyn std::fmt::Display,
    ) -> Result<(), CommError> {
        if input.len() / dtype.size() > MAX_COUNT {
            return Err(too_long(call, self.rank, input.len()));
        }
        let counts: Vec<c_int> = counts.iter().map(|&c| count(c)).collect();
        let (datatype, mpi_op) = element_op(dtype, op, self.ops);
        // SAFETY: `input` holds the sum of `counts` elements, `output` this rank's count.
        let code = unsafe {
            ffi::MPI_Reduce_scatter(
                input.as_ptr().cast(),
                output.as_mut_ptr().cast(),
                counts.as_ptr(),
                datatype,
                mpi_op,
                self.raw,
            )
        };
        check(code, call, self.rank)
    }
}

fn too_long(call: &dyn std::fmt::Display, rank: usize, bytes: usize) -> CommError {
    CommError::Mpi {
        call: call.to_string(),
        rank,
        detail: format!(
            "{bytes} bytes is more than one MPI call carries here ({MAX_COUNT} elements)"
        ),
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        let mut finalized: c_int = 0;
        // SAFETY: MPI_Finalized may be called at any time; the rest only before finalising.
        unsafe {
            ffi::MPI_Finalized(&mut finalized);
            if finalized == 0 {
                ffi::MPI_Comm_free(&mut self.raw);
            }
        }
    }
}
