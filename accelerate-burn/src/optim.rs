//! Prepared optimizers and learning-rate schedulers: they act once per optimizer update, not
//! once per micro-batch.

use burn::lr_scheduler::LrSchedulerRecord;
use burn::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::module::Module;
use burn::optim::ModuleOptimizer;

use crate::buffers::BufferSync;
use crate::error::AccelerateError;
use crate::fused::HeldBytes;
use crate::group::Comm;
use crate::model_slot::{ModelSlot, ModelSlots};
use crate::reducer::{Gradients, ModelCell, Outcome, ReducerKind};

/// A prepared optimizer: Burn's [`ModuleOptimizer`], or a fused one over flat buffers
/// ([`crate::fused`]), behind the reducer built for the prepared model; it steps only with
/// the [`Gradients`] of a completed accumulation window.
pub struct PreparedOptimizer {
    /// Its model's windows and reducer.
    slot: ModelSlot,
    comm: Comm,
    /// The model's running states (BatchNorm statistics), averaged at every update.
    buffers: Option<BufferSync>,
}

impl PreparedOptimizer {
    pub(crate) fn new(slot: ModelSlot, comm: Comm, buffers: Option<BufferSync>) -> Self {
        Self {
            slot,
            comm,
            buffers,
        }
    }

    /// Its model's windows and reducer.
    pub(crate) fn slot(&self) -> &ModelSlot {
        &self.slot
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
        let mut slot = self.slot.lock();
        if grads.reducer != slot.reducer_id {
            return Err(AccelerateError::UnexpectedGradients { rank });
        }
        let model = match grads.outcome {
            Outcome::NotDue => return Ok(model),
            // The window ended without an update (fp16 overflow on some rank, on every rank
            // alike): the running states still agree again.
            Outcome::Skipped => {
                drop(slot);
                model
            }
            outcome => {
                if grads.window != slot.windows.windows() || !slot.windows.take_update() {
                    return Err(AccelerateError::UnexpectedGradients { rank });
                }
                let mut cell = ModelCell(Some(model));
                let phase = crate::phases::optimizer();
                slot.reducer
                    .step(lr.into(), outcome, &mut cell, &self.comm)?;
                drop(phase);
                crate::phases::step_done(slot.windows.updates());
                drop(slot);
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
        self.slot.lock().windows.updates()
    }

    /// Burn's optimizer, for its records and settings (`None` for a fused optimizer).
    pub fn inner(&self) -> Option<ModuleOptimizer> {
        self.slot.lock().reducer.burn_optimizer().cloned()
    }

    /// Runs `f` on Burn's optimizer (to load a record, for instance); `None` for a fused one.
    pub fn with_inner_mut<R>(&mut self, f: impl FnOnce(&mut ModuleOptimizer) -> R) -> Option<R> {
        self.slot.lock().reducer.burn_optimizer_mut().map(f)
    }

    /// True for a fused optimizer.
    pub fn is_fused(&self) -> bool {
        self.slot.lock().reducer.kind() == ReducerKind::Fused
    }

    /// Where a fused optimizer keeps its flat buffers and runs its update: `Some(true)` on the
    /// GPU (wgpu and cuda without ZeRO), `Some(false)` on the host. `None` for Burn's optimizer.
    pub fn state_on_device(&self) -> Option<bool> {
        self.slot.lock().reducer.state_on_device()
    }

    /// Bytes of optimizer state this process holds for a fused optimizer: with ZeRO on N
    /// processes, 1/N of the unsharded amount. `None` for Burn's optimizer.
    pub fn state_bytes(&self) -> Option<usize> {
        self.held_bytes().map(|held| held.optimizer_state)
    }

    /// What a fused optimizer keeps on this process between steps: master parameters,
    /// gradients and state (ZeRO-2 on N processes holds 1/N of each). `None` for Burn's
    /// optimizer.
    pub fn held_bytes(&self) -> Option<HeldBytes> {
        self.slot.lock().reducer.held_bytes()
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
    /// The optimizer whose updates it follows.
    follows: Follows,
    advanced: u64,
    lr: ModuleLearningRate,
    /// The record from before the latest advance: a checkpoint taken after
    /// `step` was already called for the next update stores the state of this one.
    before_latest: Option<LrSchedulerRecord>,
}

impl PreparedScheduler {
    pub(crate) fn new(inner: ModuleLrScheduler, follows: Follows) -> Self {
        Self {
            inner,
            follows,
            advanced: 0,
            lr: ModuleLearningRate::default(),
            before_latest: None,
        }
    }

    /// The learning rate for the next optimizer update.
    pub fn step(&mut self) -> ModuleLearningRate {
        let wanted = self.follows.updates() + 1;
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

/// The optimizer whose updates a scheduler counts.
pub(crate) enum Follows {
    /// The first prepared model's (whichever is prepared first, also after the scheduler).
    First(ModelSlots),
    /// This model's.
    Model(ModelSlot),
}

impl Follows {
    fn updates(&self) -> u64 {
        match self {
            Self::First(slots) => slots.updates(),
            Self::Model(slot) => slot.lock().windows.updates(),
        }
    }
}
