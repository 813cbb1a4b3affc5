//! What the accelerator knows of its prepared loaders: where the training loader stands (for
//! checkpoints), where it continues after a checkpoint was loaded (the loader may be prepared
//! before or after the load), and how much of the latest batch is padding (for
//! `gather_for_metrics`). The training loader's part of a checkpoint is saved and restored
//! here, for map-style loaders (a position in the sampler's order) and stream loaders (each
//! process's own [`StreamState`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use accelerate_core::checkpoint::LoaderState;
use accelerate_core::stream_order::deal;
use accelerate_core::{
    ConsumedShares, DistributedSampler, SamplerConfig, SamplerCursor, StreamState,
};

use crate::error::AccelerateError;

/// Shared between an accelerator and its prepared loaders.
#[derive(Clone, Default)]
pub(crate) struct LoaderLinks(Arc<Mutex<Links>>);

#[derive(Default)]
struct Links {
    /// The latest prepared training loader.
    train: Option<TrainCursor>,
    /// Where the training loader continues after a checkpoint was loaded (until it takes it).
    resume: Option<ResumePoint>,
    /// The padding of the latest batch handed out (`None`: none).
    batch_padding: Option<BatchPadding>,
    /// The latest prepared training stream loader: its epoch and where it stands.
    stream: Option<(Arc<AtomicU64>, Arc<Mutex<StreamState>>)>,
    /// Where the training stream continues after a checkpoint was loaded (until it takes it),
    /// and the checkpoint.
    stream_resume: Option<(StreamState, PathBuf)>,
    /// Whether an evaluation loader was prepared for burn-train's Learner.
    #[cfg(feature = "train")]
    learner_eval: bool,
    /// Whether the latest training loader prepared for burn-train's Learner casts its
    /// batches to the compute dtype (`None`: none was prepared).
    #[cfg(feature = "train")]
    learner_train_casts: Option<bool>,
}

/// Samples of the latest batch that are padding (repeated to even out the processes' shares).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BatchPadding {
    /// A map-style loader's last round: how many samples of it, over all processes, the last
    /// ones in rank order.
    LastRound(usize),
    /// A stream loader: the last ones of this process's batch.
    Own(usize),
}

/// Where the training loader stands.
struct TrainCursor {
    /// The loader's epoch, shared so that loading a checkpoint can set it.
    epoch: Arc<AtomicU64>,
    /// This rank's sampler.
    sampler: DistributedSampler,
    /// The epoch being iterated (or last iterated).
    cursor_epoch: u64,
    /// Batches of that epoch handed to the loop.
    batches: usize,
    /// Samples of the epoch order, over all ranks, consumed before this epoch's iteration
    /// started (non-zero only when resumed with another world size).
    start_sample: usize,
    /// Data read in pieces: what runs of other world sizes consumed of this epoch before this
    /// iteration started (oldest first).
    consumed: Vec<ConsumedShares>,
}

/// Where a resumed training loader continues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResumePoint {
    /// The checkpoint it came from, for errors.
    pub checkpoint: PathBuf,
    /// How the saved loader cut its data.
    pub sampler: SamplerConfig,
    /// The epoch to continue.
    pub epoch: u64,
    /// What to skip of it.
    pub skip: Skip,
}

/// The part of a resumed epoch that was already consumed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Skip {
    /// This rank's first batches (same world size: exactly the batches it would have had).
    Batches(usize),
    /// The first samples of the epoch order over all ranks (another world size).
    Samples(usize),
    /// Data read in pieces: the shares earlier runs consumed (oldest first), then this rank's
    /// first `batches` batches of what they left.
    Pieces {
        /// What runs of other world sizes consumed.
        consumed: Vec<ConsumedShares>,
        /// This rank's batches to skip after that.
        batches: usize,
    },
}

impl TrainCursor {
    /// Moves this loader to the epoch of `point`, if it cuts its data as the saved one did.
    fn attach(&self, point: &ResumePoint, rank: usize) -> Result<(), AccelerateError> {
        if self.sampler.config() != &point.sampler {
            return Err(AccelerateError::ResumeMismatch {
                rank,
                path: point.checkpoint.clone(),
                detail: format!(
                    "the training loader differs from the saved one (saved {:?}, now {:?})",
                    point.sampler,
                    self.sampler.config()
                ),
                hint: "resume with the same data set, batch size and shuffling",
            });
        }
        self.epoch.store(point.epoch, Ordering::Relaxed);
        Ok(())
    }
}

impl LoaderLinks {
    fn lock(&self) -> MutexGuard<'_, Links> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a newly prepared training loader (checkpoints follow the latest one); a
    /// checkpoint loaded before moves it at once.
    pub fn register_train(
        &self,
        epoch: Arc<AtomicU64>,
        sampler: DistributedSampler,
        rank: usize,
    ) -> Result<(), AccelerateError> {
        let cursor = TrainCursor {
            epoch,
            sampler,
            cursor_epoch: 0,
            batches: 0,
            start_sample: 0,
            consumed: Vec::new(),
        };
        let mut links = self.lock();
        if let Some(point) = links.resume.as_ref() {
            cursor.attach(point, rank)?;
        }
        links.train = Some(cursor);
        Ok(())
    }

    /// The training loader begins iterating `epoch`: takes the resume point when it is for
    /// that epoch, and says what to skip.
    pub fn begin_epoch(&self, epoch: u64) -> Option<Skip> {
        let mut links = self.lock();
        let skip = match links.resume.take() {
            Some(point) if point.epoch == epoch => Some(point.skip.clone()),
            Some(point) => {
                tracing::warn!(
                    resumed = point.epoch,
                    epoch,
                    "the training loader was resumed at epoch {} but iterates epoch {epoch}: \
                     starting that epoch from its beginning",
                    point.epoch
                );
                None
            }
            None => None,
        };
        if let Some(cursor) = links.train.as_mut() {
            cursor.cursor_epoch = epoch;
            (cursor.batches, cursor.start_sample, cursor.consumed) = match &skip {
                Some(Skip::Batches(n)) => (*n, 0, Vec::new()),
                Some(Skip::Samples(start)) => (0, *start, Vec::new()),
                Some(Skip::Pieces { consumed, batches }) => (*batches, 0, consumed.clone()),
                None => (0, 0, Vec::new()),
            };
        }
        skip
    }

    /// Sets the epoch the training loader iterates next (burn-train's Learner counts epochs
    /// itself).
    #[cfg(feature = "train")]
    pub fn set_train_epoch(&self, epoch: u64) {
        if let Some(cursor) = self.lock().train.as_ref() {
            cursor.epoch.store(epoch, Ordering::Relaxed);
        }
    }

    /// An evaluation loader was prepared for burn-train's Learner.
    #[cfg(feature = "train")]
    pub fn note_eval_loader(&self) {
        self.lock().learner_eval = true;
    }

    /// A training loader was prepared for burn-train's Learner; `casts`: it casts batches to
    /// the compute dtype.
    #[cfg(feature = "train")]
    pub fn note_learner_train(&self, casts: bool) {
        self.lock().learner_train_casts = Some(casts);
    }

    /// Whether the latest training loader prepared for burn-train's Learner casts its batches
    /// (`None`: none was prepared).
    #[cfg(feature = "train")]
    pub fn learner_train_casts(&self) -> Option<bool> {
        self.lock().learner_train_casts
    }

    /// Whether an evaluation loader was prepared for burn-train's Learner.
    #[cfg(feature = "train")]
    pub fn has_learner_eval_loader(&self) -> bool {
        self.lock().learner_eval
    }

    /// The training loader handed out one more batch.
    pub fn count_batch(&self) {
        if let Some(cursor) = self.lock().train.as_mut() {
            cursor.batches += 1;
        }
    }

    /// Records the padding of the batch just handed out (`None`: none).
    pub fn set_batch_padding(&self, padding: Option<BatchPadding>) {
        self.lock().batch_padding = padding;
    }

    /// The padding of the latest batch handed out.
    pub fn batch_padding(&self) -> Option<BatchPadding> {
        self.lock().batch_padding
    }

    /// Registers a newly prepared training stream loader; a checkpoint loaded before moves
    /// it to its epoch at once.
    pub fn register_stream(
        &self,
        epoch: Arc<AtomicU64>,
        position: Arc<Mutex<StreamState>>,
        rank: usize,
    ) -> Result<(), AccelerateError> {
        let mut links = self.lock();
        if let Some((saved, checkpoint)) = &links.stream_resume {
            attach_stream(saved, (&epoch, &position), checkpoint, rank)?;
        }
        links.stream = Some((epoch, position));
        Ok(())
    }

    /// The training stream loader begins reading `epoch`: where it continues, when a loaded
    /// checkpoint stood in that epoch.
    pub fn take_stream_resume(&self, epoch: u64) -> Option<StreamState> {
        let (saved, _) = self.lock().stream_resume.take()?;
        if saved.epoch == epoch {
            return Some(saved);
        }
        tracing::warn!(
            resumed = saved.epoch,
            epoch,
            "the training stream was resumed at epoch {} but reads epoch {epoch}: starting \
             that epoch from its beginning",
            saved.epoch
        );
        None
    }

    /// The training stream loader's part of this process's checkpoint file (`None`
    /// without one). Saved right after a resume, before it read, it is the resumed position.
    pub fn saved_stream(&self) -> Option<StreamState> {
        let links = self.lock();
        if let Some((saved, _)) = &links.stream_resume {
            return Some(saved.clone());
        }
        let (_, position) = links.stream.as_ref()?;
        Some(
            position
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        )
    }

    /// Continues the training stream from a checkpoint: `saved`, this process's saved state
    /// when `(saved_world, world)` are equal, else every saving process's in rank order,
    /// whose remaining streams are dealt round-robin (see `accelerate_core::stream_order`).
    pub fn restore_stream(
        &self,
        saved: Vec<StreamState>,
        (saved_world, world): (usize, usize),
        checkpoint: PathBuf,
        rank: usize,
    ) -> Result<(), AccelerateError> {
        let mine = if saved_world == world {
            saved.into_iter().next()
        } else {
            deal(&saved, world)
                .map_err(|e| AccelerateError::ResumeMismatch {
                    rank,
                    path: checkpoint.clone(),
                    detail: e.to_string(),
                    hint: "resume from a checkpoint every process finished writing",
                })?
                .into_iter()
                .nth(rank)
        };
        let Some(mine) = mine else {
            return Ok(());
        };
        let mut links = self.lock();
        if let Some((epoch, position)) = &links.stream {
            attach_stream(&mine, (epoch, position), &checkpoint, rank)?;
        }
        links.stream_resume = Some((mine, checkpoint));
        Ok(())
    }

    /// The training loader's part of a checkpoint (`None` without one). Saved right after a
    /// resume, before the loader iterated, it is the resumed position (not yet applied).
    pub fn saved_state(&self) -> Option<LoaderState> {
        let links = self.lock();
        let cursor = links.train.as_ref()?;
        let sampler = &cursor.sampler;
        if let Some(point) = &links.resume {
            let (batches, start_sample, consumed, shares) = match &point.skip {
                Skip::Batches(n) => (
                    *n,
                    0,
                    n.saturating_mul(sampler.global_batch_size()),
                    Vec::new(),
                ),
                Skip::Samples(start) => (0, *start, *start, Vec::new()),
                Skip::Pieces { consumed, batches } => (
                    *batches,
                    0,
                    batches.saturating_mul(sampler.global_batch_size()),
                    consumed.clone(),
                ),
            };
            return Some(LoaderState {
                cursor: SamplerCursor {
                    epoch: point.epoch,
                    batches_consumed: batches,
                },
                start_sample,
                samples_consumed: consumed.min(point.sampler.len),
                sampler: point.sampler.clone(),
                consumed_shares: shares,
            });
        }
        let epoch_len = if cursor.consumed.is_empty() {
            sampler.len_from_sample(cursor.start_sample)
        } else {
            sampler.len_after(&cursor.consumed)
        };
        // A finished epoch resumes at the start of the next one.
        let (epoch, batches, start_sample, shares) = if cursor.batches >= epoch_len {
            (cursor.cursor_epoch + 1, 0, 0, Vec::new())
        } else {
            (
                cursor.cursor_epoch,
                cursor.batches,
                cursor.start_sample,
                cursor.consumed.clone(),
            )
        };
        Some(LoaderState {
            cursor: SamplerCursor {
                epoch,
                batches_consumed: batches,
            },
            start_sample,
            samples_consumed: (start_sample + batches * sampler.global_batch_size())
                .min(sampler.config().len),
            sampler: sampler.config().clone(),
            consumed_shares: shares,
        })
    }

    /// Continues from a checkpoint's `saved` loader state: the training loader (prepared now
    /// or later) moves to its epoch and skips what was consumed. `(saved_world, world)`: the
    /// processes that saved the checkpoint and this job's.
    pub fn restore(
        &self,
        saved: LoaderState,
        (saved_world, world): (usize, usize),
        checkpoint: PathBuf,
        rank: usize,
    ) -> Result<(), AccelerateError> {
        let batches = saved.cursor.batches_consumed;
        let skip = if saved.sampler.pieces.is_some() {
            let mut consumed = saved.consumed_shares;
            if saved_world == world {
                Skip::Pieces { consumed, batches }
            } else {
                let rank_batch_size = if saved.sampler.split_batches {
                    saved.sampler.batch_size / saved_world.max(1)
                } else {
                    saved.sampler.batch_size
                };
                consumed.push(ConsumedShares {
                    world_size: saved_world,
                    rank_batch_size,
                    batches,
                });
                Skip::Pieces {
                    consumed,
                    batches: 0,
                }
            }
        } else if saved_world == world && saved.start_sample == 0 {
            Skip::Batches(batches)
        } else {
            Skip::Samples(saved.samples_consumed)
        };
        let point = ResumePoint {
            checkpoint,
            sampler: saved.sampler,
            epoch: saved.cursor.epoch,
            skip,
        };
        let mut links = self.lock();
        if let Some(cursor) = links.train.as_ref() {
            cursor.attach(&point, rank)?;
        }
        links.resume = Some(point);
        Ok(())
    }
}

/// Moves a training stream loader (its `epoch` and `position`) to the epoch of `saved`, if
/// it cuts its data as the saved one did.
fn attach_stream(
    saved: &StreamState,
    (epoch, position): (&AtomicU64, &Mutex<StreamState>),
    checkpoint: &std::path::Path,
    rank: usize,
) -> Result<(), AccelerateError> {
    let config = position
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .config
        .clone();
    if saved.config != config {
        return Err(AccelerateError::ResumeMismatch {
            rank,
            path: checkpoint.to_path_buf(),
            detail: format!(
                "the training stream differs from the saved one (saved {:?}, now {:?})",
                saved.config, config
            ),
            hint: "resume with the same source shards, batch size, shuffling and shuffle buffer",
        });
    }
    epoch.store(saved.epoch, Ordering::Relaxed);
    Ok(())
}
