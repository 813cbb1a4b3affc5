//! Asynchronous saves: the files a save staged (its snapshot) are made durable on a thread of
//! their own while training goes on, and the main process commits the checkpoint as soon as
//! every rank's part is on disk.
//!
//! No collective runs off the training thread. Each rank's writer leaves a marker in the
//! partial directory when its files are synced (`.rank_<r>.written`, or `.rank_<r>.failed`
//! holding the error); the main process's writer waits for every rank's marker, then removes
//! them and commits (and rotates) exactly as a synchronous save does. What happened is agreed
//! on the training thread, at the next call that touches checkpoints ([`BackgroundSave::finish`]):
//! first every rank's own write, then the commit. A crash at any moment leaves the previous
//! checkpoint the latest: nothing is renamed into place before every file is synced.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use accelerate_core::checkpoint::{self, CheckpointRotation, Manifest};

use super::staging::Pending;
use super::{Context, StageError};
use crate::error::AccelerateError;

/// How long the main process's writer waits for the other ranks' parts.
const WAIT_FOR_RANKS: Duration = Duration::from_secs(600);
/// How often it looks.
const POLL: Duration = Duration::from_millis(20);
/// Fault injection for tests: `<rank>:<n>` aborts rank `<rank>` at the n-th point of a
/// background save (counting from 1: before each file, before its marker, before the commit);
/// `<rank>:<n>:fail` makes that point fail as a write would.
const FAULT_AT: &str = "ACCELERATE_FAULT_BACKGROUND_SAVE_AT";

/// What the main process commits once every rank's part is on disk.
pub(crate) struct CommitJob {
    pub dir: PathBuf,
    pub partial: PathBuf,
    pub manifest: Manifest,
    pub world_size: usize,
    /// The project's rotation, for automatically named checkpoints.
    pub rotation: Option<CheckpointRotation>,
}

/// Why a background save failed, on the rank whose writer says so.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BackgroundSaveError {
    /// This rank's files could not be written or synced.
    #[error(transparent)]
    Write(#[from] StageError),
    /// Other ranks' writers failed (each `rank r: why`).
    #[error("{0}")]
    Ranks(String),
    /// Ranks that did not leave their marker in time.
    #[error("ranks {ranks:?} did not write their part within {seconds} s")]
    Late {
        /// The ranks waited for.
        ranks: Vec<usize>,
        /// How long.
        seconds: u64,
    },
    /// The training thread gave up on the save (a peer failed).
    #[error("abandoned before every rank had written its part")]
    Abandoned,
    /// The commit or the rotation after it failed.
    #[error(transparent)]
    Commit(#[from] accelerate_core::CheckpointError),
    /// The writer thread ended without saying how it went.
    #[error("the checkpoint writer thread stopped (it panicked)")]
    WriterGone,
}

/// A save whose files are being written.
pub(crate) struct BackgroundSave {
    dir: PathBuf,
    /// Why this rank's own files could not be made durable, once they are (`None`: they are).
    written: mpsc::Receiver<Option<String>>,
    /// Ends when the rank's part is done; on the main process, after the commit.
    thread: JoinHandle<Result<(), BackgroundSaveError>>,
    /// Tells the main process's writer to stop waiting for the others.
    abandon: Arc<AtomicBool>,
}

/// The marker rank `rank` leaves when its files are synced (`ok`) or failed.
fn marker(partial: &Path, rank: usize, ok: bool) -> PathBuf {
    let outcome = if ok { "written" } else { "failed" };
    partial.join(format!(".rank_{rank}.{outcome}"))
}

/// Counts the points of a background save and injects the fault [`FAULT_AT`] names there.
struct FaultPoints {
    /// The point, and whether it fails (else the process aborts).
    at: Option<(u64, bool)>,
    passed: u64,
}

impl FaultPoints {
    fn from_env(rank: usize) -> Self {
        let text = std::env::var(FAULT_AT).unwrap_or_default();
        let parts: Vec<&str> = text.trim().split(':').collect();
        let at = match parts.as_slice() {
            [r, n, rest @ ..] if r.parse() == Ok(rank) => {
                n.parse().ok().map(|n| (n, rest.first() == Some(&"fail")))
            }
            _ => None,
        };
        Self { at, passed: 0 }
    }

    /// Passes one point (`what` is about to happen to `path`).
    fn pass(&mut self, what: &str, path: &Path) -> Result<(), StageError> {
        self.passed = self.passed.saturating_add(1);
        match self.at {
            Some((n, fails)) if n == self.passed => {
                eprintln!("{FAULT_AT}: {what} {}", path.display());
                if !fails {
                    std::process::abort();
                }
                Err(StageError::Io {
                    path: path.to_path_buf(),
                    source: std::io::Error::other(format!("injected fault ({FAULT_AT})")),
                })
            }
            _ => Ok(()),
        }
    }
}

/// Starts writing `pending` (rank `rank`'s staged files into `partial`, the save of `dir`) in
/// the background; the main process passes the `commit` that follows.
pub(crate) fn start(
    rank: usize,
    dir: PathBuf,
    partial: PathBuf,
    pending: Pending,
    commit: Option<CommitJob>,
) -> Result<BackgroundSave, std::io::Error> {
    let (tx, written) = mpsc::channel();
    let abandon = Arc::new(AtomicBool::new(false));
    let stop = abandon.clone();
    let thread = std::thread::Builder::new()
        .name("accelerate-checkpoint".into())
        .spawn(move || {
            let mut faults = FaultPoints::from_env(rank);
            let mut mine = pending
                .make_durable(|path| faults.pass("before writing", path))
                .and_then(|()| faults.pass("before the marker of", &partial));
            let (path, text) = match &mine {
                Ok(()) => (marker(&partial, rank, true), String::new()),
                Err(e) => (marker(&partial, rank, false), e.to_string()),
            };
            // Whole when it appears (the main process reads a failure's text).
            let marked =
                checkpoint::create_file(&path, |temporary| std::fs::write(temporary, &text));
            if let (Ok(()), Err(e)) = (&mine, marked) {
                mine = Err(e.into());
            }
            let _ = tx.send(mine.as_ref().err().map(ToString::to_string));
            mine?;
            match commit {
                Some(job) => commit_when_written(job, &stop, &mut faults),
                None => Ok(()),
            }
        })?;
    Ok(BackgroundSave {
        dir,
        written,
        thread,
        abandon,
    })
}

/// Waits for every rank's marker, then commits `job` (and rotates); a failed rank's part
/// fails the save, naming it, and the partial directory is removed.
fn commit_when_written(
    job: CommitJob,
    abandon: &AtomicBool,
    faults: &mut FaultPoints,
) -> Result<(), BackgroundSaveError> {
    let started = Instant::now();
    let mut waiting: Vec<usize> = (0..job.world_size).collect();
    let mut failed = Vec::new();
    while !waiting.is_empty() {
        waiting.retain(|&rank| {
            if marker(&job.partial, rank, true).exists() {
                return false;
            }
            let failure = marker(&job.partial, rank, false);
            if failure.exists() {
                let why = std::fs::read_to_string(&failure).unwrap_or_default();
                failed.push(format!("rank {rank}: {why}"));
                return false;
            }
            true
        });
        if waiting.is_empty() {
            break;
        }
        if abandon.load(Ordering::Relaxed) {
            return Err(BackgroundSaveError::Abandoned);
        }
        if started.elapsed() > WAIT_FOR_RANKS {
            return Err(BackgroundSaveError::Late {
                ranks: waiting,
                seconds: WAIT_FOR_RANKS.as_secs(),
            });
        }
        std::thread::sleep(POLL);
    }
    if !failed.is_empty() {
        let _ = std::fs::remove_dir_all(&job.partial);
        return Err(BackgroundSaveError::Ranks(failed.join("; ")));
    }
    for rank in 0..job.world_size {
        let path = marker(&job.partial, rank, true);
        std::fs::remove_file(&path).map_err(|source| StageError::Io { path, source })?;
    }
    faults.pass("before the commit of", &job.dir)?;
    checkpoint::commit(&job.dir, &job.partial, job.manifest)?;
    if let Some(rotation) = job.rotation {
        for path in rotation.rotate(&job.dir)? {
            tracing::info!(path = %path.display(), "old checkpoint removed");
        }
    }
    tracing::info!(dir = %job.dir.display(), "checkpoint committed in the background");
    Ok(())
}

impl BackgroundSave {
    /// Waits for the save (every process calls it at the same point) and agrees on how it
    /// went: each rank's own files first, then the main process's commit.
    pub(crate) fn finish(self, ctx: &Context<'_>) -> Result<(), AccelerateError> {
        let why = self
            .written
            .recv()
            .unwrap_or_else(|_| Some(BackgroundSaveError::WriterGone.to_string()));
        let dir = self.dir.clone();
        let mine = match why {
            None => Ok(()),
            Some(why) => Err(why),
        };
        let agreed = ctx.agree(&dir, "writing the checkpoint in the background", mine);
        if agreed.is_err() {
            self.abandon.store(true, Ordering::Relaxed);
        }
        let committed = self
            .thread
            .join()
            .unwrap_or(Err(BackgroundSaveError::WriterGone));
        agreed?;
        ctx.agree(
            &dir,
            "committing the checkpoint in the background",
            committed,
        )
    }

    /// Gives the save up without waiting: the main process's writer stops waiting for the
    /// others and commits nothing (the next save removes the partial directory).
    pub(crate) fn abandon(self) {
        self.abandon.store(true, Ordering::Relaxed);
    }

    /// At the end of the process: lets the save finish, with no collective (the main
    /// process waits at most [`WAIT_FOR_RANKS`] for the other ranks' parts, and not at all when
    /// `peers_failed`: a failed peer's part never comes); what fails is logged.
    pub(crate) fn finish_at_exit(self, peers_failed: bool) {
        if peers_failed {
            self.abandon.store(true, Ordering::Relaxed);
        }
        match self.thread.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(
                dir = %self.dir.display(),
                "background checkpoint save failed; the previous checkpoint stays the latest: {e}"
            ),
            Err(_) => tracing::error!(dir = %self.dir.display(), "the checkpoint writer panicked"),
        }
    }
}
