//! Prepared optimizers and learning-rate schedulers: they act once per optimizer update, not
//! once per micro-batch.

use burn::lr_scheduler::LrSchedulerRecord;
use burn::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::module::Module;
use burn::optim::ModuleOptimizer;

use crate::buffers::BufferSync;
use crate::error::AccelerateError;
use crate::group::Comm;
use crate::reducer::{Gradients, ModelCell, Outcome, ReducerHandle, ReducerKind};
use crate::training_loop::SharedLoop;

/// A prepared optimizer: Burn's [`ModuleOptimizer`], or a fused one over flat buffers
/// ([`crate::fused`]), behind the reducer built for the prepared model; it steps only with
/// the [`Gradients`] of a completed accumulation window.
pub struct PreparedOptimizer {
    reducer: ReducerHandle,
    /// Its model's slot in the training loop.
    slot: usize,
    training: SharedLoop,
    comm: Comm,
    /// The model's running states (BatchNorm statistics), averaged at every update.
    buffers: Option<BufferSync>,
}

impl PreparedOptimizer {
    pub(crate) fn new(
        reducer: ReducerHandle,
        slot: usize,
        training: SharedLoop,
        comm: Comm,
        buffers: Option<BufferSync>,
    ) -> Self {
        Self {
            reducer,
            slot,
            training,
            comm,
            buffers,
        }
    }

    /// Its model's slot in the training loop.
    pub(crate) fn slot(&self) -> usize {
        self.slot
    }

    /// Applies `grads` (from [`Accelerator::backward`](crate::Accelerator::backward)) with
    /// learning rate `lr` (a number, or a prepared scheduler's step) when they complete an
    /// update, and returns the updated model; with gradients that are
    /// [`NotDue`](crate::GradientsStatus::NotDue) or [`Skipped`](crate::GradientsStatus::Skipped)
    /// returns `model` unchanged.
    ///
    /// Gradients of an earlier window (kept past a later `backward`), of another accelerator,
    /// or a second step for the same update are an error rather than a silent no-op.
    pub fn step<M: Module>(
        &mut self,
        lr: impl Into<ModuleLearningRate>,
        model: M,
        grads: Gradients,
    ) -> Result<M, AccelerateError> {
        let rank = self.comm.rank();
        let mut training = self.training.lock();
        if grads.reducer != self.reducer.id {
            return Err(AccelerateError::UnexpectedGradients { rank });
        }
        let model = match grads.outcome {
            Outcome::NotDue => return Ok(model),
            // The window ended without an update (fp16 overflow on some rank, on every rank
            // alike): the running states still agree again.
            Outcome::Skipped => {
                drop(training);
                model
            }
            outcome => {
                if grads.window != training.windows(self.slot) || !training.take_update(self.slot) {
                    return Err(AccelerateError::UnexpectedGradients { rank });
                }
                let mut cell = ModelCell(Some(model));
                self.reducer
                    .lock()
                    .step(lr.into(), outcome, &mut cell, &self.comm)?;
                drop(training);
                cell.0
                    .ok_or(AccelerateError::UnexpectedGradients { rank })?
            }
        };
        match &self.buffers {
            Some(buffers) => buffers.average(model, &self.comm),
            None => Ok(model),
        }
    }

    /// Updates this optimizer applied so far.
    pub fn updates(&self) -> u64 {
        self.training.lock().updates(self.slot)
    }

    /// Burn's optimizer, for its records and settings (`None` for a fused optimizer).
    pub fn inner(&self) -> Option<ModuleOptimizer> {
        self.reducer.lock().burn_optimizer().cloned()
    }

    /// Runs `f` on Burn's optimizer (to load a record, for instance); `None` for a fused one.
    pub fn with_inner_mut<R>(&mut self, f: impl FnOnce(&mut ModuleOptimizer) -> R) -> Option<R> {
        self.reducer.lock().burn_optimizer_mut().map(f)
    }

    /// True for a fused optimizer.
    pub fn is_fused(&self) -> bool {
        self.reducer.lock().kind() == ReducerKind::Fused
    }

    /// Where a fused optimizer keeps its flat buffers and runs its update: `Some(true)` on the
    /// GPU (wgpu and cuda without ZeRO), `Some(false)` on the host. `None` for Burn's optimizer.
    pub fn state_on_device(&self) -> Option<bool> {
        self.reducer.lock().state_on_device()
    }

    /// Bytes of optimizer state this process holds for a fused optimizer: with ZeRO-1 on N
    /// processes, 1/N of the unsharded amount. `None` for Burn's optimizer.
    pub fn state_bytes(&self) -> Option<usize> {
        self.reducer.lock().state_bytes()
    }

    /// The reducer, for checkpoints.
    pub(crate) fn reducer(&self) -> &ReducerHandle {
        &self.reducer
    }
}

/// Burn's [`ModuleLrScheduler`] (what every scheduler config's `init` returns), advancing
/// once per optimizer update.
///
/// [`step`](Self::step) returns the learning rate of the next update to be applied: the
/// `k`-th update uses the scheduler's `k`-th value however many micro-batches it accumulates,
/// and whether `step` is called before or after `backward`. (Accelerate's prepared scheduler
/// steps once per process per micro-batch; schedules here count updates.)
pub struct PreparedScheduler {
    inner: ModuleLrScheduler,
    training: SharedLoop,
    /// The slot of the optimizer whose updates it follows.
    slot: usize,
    advanced: u64,
    lr: ModuleLearningRate,
    /// The record from before the latest advance: a checkpoint taken after
    /// `step` was already called for the next update stores the state of this one.
    before_latest: Option<LrSchedulerRecord>,
}

impl PreparedScheduler {
    pub(crate) fn new(inner: ModuleLrScheduler, training: SharedLoop, slot: usize) -> Self {
        Self {
            inner,
            training,
            slot,
            advanced: 0,
            lr: ModuleLearningRate::default(),
            before_latest: None,
        }
    }

    /// The learning rate for the next optimizer update.
    pub fn step(&mut self) -> ModuleLearningRate {
        let wanted = self.training.lock().updates(self.slot) + 1;
        while self.advanced < wanted {
            self.before_latest = Some(self.inner.to_record());
            self.lr = self.inner.step();
            self.advanced += 1;
        }
        self.lr.clone()
    }

    /// Burn's scheduler, for its record.
    pub fn inner(&self) -> &ModuleLrScheduler {
        &self.inner
    }

    /// The scheduler's record after `updates` advances, which is what a checkpoint taken
    /// after `updates` updates stores; `None` when it advanced further (it cannot go back).
    pub(crate) fn record_at(&self, updates: u64) -> Option<LrSchedulerRecord> {
        if self.advanced == updates {
            Some(self.inner.to_record())
        } else if self.advanced == updates + 1 {
            self.before_latest.clone()
        } else {
            None
        }
    }

    /// Continues from `record`, taken after `updates` advances.
    pub(crate) fn restore(&mut self, record: LrSchedulerRecord, updates: u64) {
        self.inner = self.inner.clone().load_record(record);
        self.advanced = updates;
        self.before_latest = None;
    }
}
