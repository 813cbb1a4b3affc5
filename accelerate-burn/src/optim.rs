//! Prepared optimizers and learning-rate schedulers: they act once per optimizer update, not
//! once per micro-batch.

use burn::lr_scheduler::LrSchedulerRecord;
use burn::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};

use std::sync::{Arc, Mutex, PoisonError};

use accelerate_core::comm::ProcessGroup;

use crate::error::AccelerateError;
use crate::loop_state::SharedLoop;

/// A prepared optimizer: Burn's [`ModuleOptimizer`], or a fused one over flat buffers
/// ([`crate::fused`]); either steps only when the latest backward pass completed an
/// accumulation window.
pub struct PreparedOptimizer {
    kind: Kind,
    shared: SharedLoop,
}

enum Kind {
    Burn(ModuleOptimizer),
    /// The flat buffers live in the shared loop state; the group gathers ZeRO shards.
    Fused(Arc<Mutex<ProcessGroup>>),
}

impl PreparedOptimizer {
    pub(crate) fn new(inner: ModuleOptimizer, shared: SharedLoop) -> Self {
        Self {
            kind: Kind::Burn(inner),
            shared,
        }
    }

    pub(crate) fn fused(shared: SharedLoop, group: Arc<Mutex<ProcessGroup>>) -> Self {
        Self {
            kind: Kind::Fused(group),
            shared,
        }
    }

    /// Applies `grads` (from [`Accelerator::backward`](crate::Accelerator::backward)) with
    /// learning rate `lr` (a number, or a prepared scheduler's step) when an update is due,
    /// and returns the updated model; on the other micro-batches returns `model` unchanged.
    ///
    /// Gradients that no completed window produced (a second step for the same update, or
    /// gradients from a plain `loss.backward()`) are an error rather than a silent no-op.
    pub fn step<M: Module>(
        &mut self,
        lr: impl Into<ModuleLearningRate>,
        model: M,
        grads: GradientsParams,
    ) -> Result<M, AccelerateError> {
        let mut shared = self.shared.lock();
        let (due, rank) = (shared.accumulation.take_update(), shared.rank);
        if !due {
            return if grads.is_empty() {
                Ok(model)
            } else {
                Err(AccelerateError::UnexpectedGradients { rank })
            };
        }
        let mixed = AccelerateError::FusedOptimizer {
            reason: "this accelerator has both Burn's optimizer and a fused one prepared, and \
                     backward feeds only the fused one. hint: prepare one optimizer per \
                     accelerator"
                .into(),
        };
        match &mut self.kind {
            Kind::Burn(_) if shared.flat.is_some() => Err(mixed),
            Kind::Burn(inner) => {
                drop(shared);
                Ok(inner.step(lr, model, grads))
            }
            Kind::Fused(group) => {
                if !grads.is_empty() {
                    return Err(AccelerateError::UnexpectedGradients { rank });
                }
                let Some(engine) = shared.flat.as_mut() else {
                    return Err(mixed);
                };
                let optimizer = engine.optimizer.clone();
                let sharded = engine.zero_stage >= 1;
                let Some(layout) = engine.layout.as_mut().filter(|l| l.grads_ready) else {
                    return Err(AccelerateError::UnexpectedGradients { rank });
                };
                layout.grads_ready = false;
                // fp16 unscale and clipping in one factor, applied in the update pass.
                let grad_scale = layout.unscale * layout.clip_factor;
                layout.step(&optimizer, &lr.into(), grad_scale);
                if sharded && layout.shard.len() < layout.padded {
                    let mut group = group.lock().unwrap_or_else(PoisonError::into_inner);
                    layout.gather_params(&mut group)?;
                }
                Ok(layout.upload(model))
            }
        }
    }

    /// Optimizer updates applied so far.
    pub fn updates(&self) -> u64 {
        self.shared.lock().accumulation.updates()
    }

    /// Burn's optimizer, for its records and settings (`None` for a fused optimizer).
    pub fn inner(&self) -> Option<&ModuleOptimizer> {
        match &self.kind {
            Kind::Burn(inner) => Some(inner),
            Kind::Fused(_) => None,
        }
    }

    /// Burn's optimizer, mutably (to load a record, for instance; `None` for a fused one).
    pub fn inner_mut(&mut self) -> Option<&mut ModuleOptimizer> {
        match &mut self.kind {
            Kind::Burn(inner) => Some(inner),
            Kind::Fused(_) => None,
        }
    }

    /// True for a fused optimizer.
    pub fn is_fused(&self) -> bool {
        matches!(self.kind, Kind::Fused(_))
    }

    /// Where a fused optimizer keeps its flat buffers and runs its update: `Some(true)` on the
    /// GPU (wgpu and cuda without ZeRO), `Some(false)` on the host. `None` for Burn's optimizer,
    /// and before the first completed window.
    pub fn state_on_device(&self) -> Option<bool> {
        let shared = self.shared.lock();
        let layout = shared.flat.as_ref()?.layout.as_ref()?;
        Some(layout.device.is_some())
    }

    /// Bytes of optimizer state (moments, velocities) this process holds for a fused optimizer:
    /// with ZeRO-1 on N processes, 1/N of the unsharded amount. `None` for Burn's optimizer,
    /// and before the first completed window.
    pub fn state_bytes(&self) -> Option<usize> {
        let shared = self.shared.lock();
        let layout = shared.flat.as_ref()?.layout.as_ref()?;
        Some(layout.state_bytes())
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
    shared: SharedLoop,
    advanced: u64,
    lr: ModuleLearningRate,
    /// The record from before the latest advance: a checkpoint taken after
    /// `step` was already called for the next update stores the state of this one.
    before_latest: Option<LrSchedulerRecord>,
}

impl PreparedScheduler {
    pub(crate) fn new(inner: ModuleLrScheduler, shared: SharedLoop) -> Self {
        Self {
            inner,
            shared,
            advanced: 0,
            lr: ModuleLearningRate::default(),
            before_latest: None,
        }
    }

    /// The learning rate for the next optimizer update.
    pub fn step(&mut self) -> ModuleLearningRate {
        let wanted = self.shared.lock().accumulation.updates() + 1;
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
