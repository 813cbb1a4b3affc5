//! The MPI engine (feature `mpi`): our collectives over the MPI library a cluster already runs
//! (Open MPI or MPICH, over whatever network it is tuned for), for jobs started by `mpirun` or
//! `srun --mpi=pmix`. `ACCELERATE_TRANSPORT=mpi` selects it; `auto` picks it under those
//! launchers in a build with the feature.
//!
//! What MPI does not give, the engine adds:
//! - **Mismatch detection**: ranks that make different calls are told so, naming a rank and
//!   both calls. Each rank records its calls on its host's progress board ([`board`], shared
//!   memory), where the watchdogs compare them with the local peers' within a tick (0.1 s) and
//!   end the job with the error; when the job spans hosts, every call also carries a check
//!   through MPI ([`agreement`]), appended to small f32 all-reduces and reduced just before
//!   everything else, so that the call itself returns [`CommError::Mismatch`].
//! - **No hangs** ([`watchdog`]): a call that meets a different call on this host, outlasts
//!   `ACCELERATE_TIMEOUT`, or waits for a silent peer on this host, ends the job with
//!   `MPI_Abort`, naming the rank.
//! - **A failed rank ends the job**: a process that exits with a non-zero status, or after one
//!   of its groups failed, aborts the job instead of finalising (a finalising rank would wait for
//!   peers that wait for it); see the `runtime` module.
//!
//! f32 travels as `MPI_FLOAT` with MPI's own operations; f16 and bf16 travel as 16-bit words
//! reduced by our operation (each combination in f32, rounded once), so halves cost half the
//! bytes of f32 on the wire.

pub mod agreement;
pub mod board;
mod runtime;
pub mod watchdog;

use std::sync::Arc;
use std::time::Duration;

use accelerate_kernels::{DType, ReduceOp};

use super::shm::{create_private, open_private};
use crate::comm::call::CallDesc;
use crate::comm::engine::Engine;
use crate::comm::options::GroupOptions;
use crate::error::CommError;
use crate::state::ProcessState;
use board::Board;
use runtime::Comm;
use watchdog::{Identity, Watchdog};

/// In a job spanning hosts, f32 all-reduces up to this many bytes travel in one MPI call with
/// their check appended (a copy in and out); larger ones, and every other call, are preceded
/// by a check-only call.
pub const INLINE_BYTES: usize = 64 << 10;

/// One rank's MPI engine.
pub struct MpiEngine {
    comm: Comm,
    rank: usize,
    world_size: usize,
    /// Payload and check of the call in progress.
    message: Vec<f32>,
    /// Every call, as this rank's peers on this host see it.
    board: Arc<Board>,
    /// Whether calls also carry a check through MPI (some rank is not on the board).
    in_band: bool,
    /// Declared after `comm`: stops before the communicator goes.
    watchdog: Watchdog,
}

impl MpiEngine {
    /// Joins the job MPI was started with: initialises MPI (once per process), checks that it
    /// agrees with the launcher's variables in `state`, and sets up this host's progress board
    /// and the watchdog.
    pub fn new(state: &ProcessState, options: &GroupOptions) -> Result<Self, CommError> {
        runtime::init(state.rank)?;
        let comm = Comm::world(state.rank)?;
        let (rank, world_size) = comm.rank_and_size()?;
        if (rank, world_size) != (state.rank, state.world_size) {
            return Err(CommError::Mpi {
                call: "setup".into(),
                rank: state.rank,
                detail: format!(
                    "MPI says this is rank {rank} of {world_size}, the {} variables say rank {} \
                     of {}. hint: under srun, start MPI jobs with --mpi=pmix; otherwise use \
                     ACCELERATE_TRANSPORT=auto (our own transports)",
                    state.launcher, state.rank, state.world_size
                ),
            });
        }
        let mut host = comm.this_host()?;
        let (local_index, local_size) = host.rank_and_size()?;
        let mut ranks = vec![0u8; 8 * local_size];
        host.all_gather(&(rank as u64).to_le_bytes(), &mut ranks, &"setup")?;
        let local: Vec<usize> = ranks
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()) as usize)
            .collect();
        let board = Arc::new(
            open_board(&mut host, local_index, &local)?.unwrap_or_else(|| Board::private(rank)),
        );
        let in_band = !board.is_shared() || board.ranks().len() < world_size;
        let watchdog = Watchdog::start(
            Identity {
                rank,
                world_size,
                heartbeat_timeout: options.heartbeat_timeout,
            },
            Arc::clone(&board),
            options.timeout,
        );
        Ok(Self {
            comm,
            rank,
            world_size,
            message: Vec::new(),
            board,
            in_band,
            watchdog,
        })
    }

    /// Runs `f` as `call`: recorded on the board, where the watchdogs compare it with the
    /// peers' calls; when MPI fails, a different call of a peer is the error to report.
    fn guarded(
        &mut self,
        call: &CallDesc,
        f: impl FnOnce(&mut Self) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        self.board.enter(call);
        let result = f(self);
        self.board.leave(call);
        if let Err(error) = result {
            runtime::mark_failed();
            return Err(match self.board.differing(call) {
                Some((peer, theirs)) => agreement::named_mismatch(self.rank, call, peer, theirs),
                None => error,
            });
        }
        Ok(())
    }

    /// Checks, in a job spanning hosts, that every rank makes `call` (one check-only sum; also
    /// a barrier).
    fn agree_in_band(&mut self, call: &CallDesc) -> Result<(), CommError> {
        if self.in_band {
            self.reduce_checked(call, &[], ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// All-reduces `payload` (f32) by `op` in one MPI call with the check of `call` appended,
    /// leaving the result in `self.message`; a mismatch is described to every rank.
    fn reduce_checked(
        &mut self,
        call: &CallDesc,
        payload: &[f32],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let len = agreement::message_floats(payload.len());
        self.message.clear();
        self.message.extend_from_slice(payload);
        self.message.resize(len - agreement::CHECK_FLOATS, 0.0);
        self.message
            .extend(agreement::encode(call, self.world_size, op));
        self.comm.all_reduce(
            bytemuck::cast_slice_mut(&mut self.message),
            DType::F32,
            op,
            call,
        )?;
        if agreement::agreed(
            &self.message[len - agreement::CHECK_FLOATS..],
            self.world_size,
            op,
        ) {
            return Ok(());
        }
        // Every rank saw the same sums, so every rank gathers the calls.
        let mut calls = vec![0u8; 32 * self.world_size];
        let mine = call.pack().map(u64::to_le_bytes).concat();
        self.comm.all_gather(&mine, &mut calls, call)?;
        Err(agreement::mismatch(&calls, call, self.rank))
    }
}

/// Maps this host's progress board: its first rank creates the file, every local rank maps
/// it, the file is removed once all have. Without one (no /dev/shm), errors name fewer ranks.
fn open_board(
    host: &mut Comm,
    local_index: usize,
    local: &[usize],
) -> Result<Option<Board>, CommError> {
    let bytes = Board::bytes(local.len());
    let mut name = [0u8; 16];
    let mut created = [0u8; 1];
    if local_index == 0 {
        name = crate::comm::auth::random_bytes().unwrap_or([0; 16]);
        let path = watchdog::board_path(&hex(&name));
        if let Some(dir) = path.parent() {
            super::shm::stale::sweep(dir, super::shm::stale::STALE_AFTER);
        }
        created[0] = u8::from(create_private(&path, bytes).is_ok());
    }
    let mut shared = [name.as_slice(), &created].concat();
    host.broadcast(&mut shared, 0, &"setup")?;
    let path = watchdog::board_path(&hex(&shared[..16]));
    let board = if shared[16] == 1 {
        open_private(&path, true, bytes)
            .and_then(|file| Board::map(&file, local_index, local.to_vec()))
            .map_err(|e| tracing::warn!("no progress board at {}: {e}", path.display()))
            .ok()
    } else {
        None
    };
    // Everyone mapped it (or gave up): the name can go.
    host.all_gather(&[1], &mut vec![0u8; local.len()], &"setup")?;
    if local_index == 0 {
        let _ = std::fs::remove_file(&path);
    }
    Ok(board)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Drop for MpiEngine {
    /// The last look at the board: calls made since the watchdog's last tick are compared
    /// too, so that a job never ends well after a mismatch.
    fn drop(&mut self) {
        let done = self.board.left(self.board.mine());
        if let Some(error) = self.board.first_mismatch(0..done) {
            watchdog::end_job(self.rank, &error);
        }
    }
}

impl Engine for MpiEngine {
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        let (dtype, op) = call.reduction(self.rank)?;
        self.guarded(call, |e| {
            if e.in_band
                && dtype == DType::F32
                && buf.len() <= INLINE_BYTES
                && let Ok(values) = bytemuck::try_cast_slice_mut::<u8, f32>(buf)
            {
                e.reduce_checked(call, values, op)?;
                values.copy_from_slice(&e.message[..values.len()]);
            } else {
                e.agree_in_band(call)?;
                e.comm.all_reduce(buf, dtype, op, call)?;
            }
            if let Some(factor) = scale {
                accelerate_kernels::reduce::scale_bytes(dtype, buf, factor);
            }
            Ok(())
        })
    }

    fn broadcast(&mut self, call: &CallDesc, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        self.guarded(call, |e| {
            e.agree_in_band(call)?;
            e.comm.broadcast(buf, root, call)
        })
    }

    fn all_gather(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), CommError> {
        self.guarded(call, |e| {
            e.agree_in_band(call)?;
            e.comm.all_gather(input, output, call)
        })
    }

    fn reduce_scatter(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
        counts: &[usize],
    ) -> Result<(), CommError> {
        let (dtype, op) = call.reduction(self.rank)?;
        self.guarded(call, |e| {
            e.agree_in_band(call)?;
            e.comm
                .reduce_scatter(input, output, counts, dtype, op, call)
        })
    }

    fn barrier(&mut self, call: &CallDesc) -> Result<(), CommError> {
        // A check-only sum is a barrier, whether or not the check is needed.
        self.guarded(call, |e| e.reduce_checked(call, &[], ReduceOp::Sum))
    }

    fn abort(&mut self, reason: &str) {
        // MPI cannot tell the peers; the exit hook aborts the job when this process ends, and
        // the peers' watchdogs bound their wait until then.
        tracing::debug!(rank = self.rank, "{reason}");
        runtime::mark_failed();
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.watchdog.set_timeout(timeout);
    }
}
