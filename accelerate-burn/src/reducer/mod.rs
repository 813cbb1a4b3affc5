//! The seam between `backward` and the optimizer: one [`GradientReducer`] per prepared model.
//!
//! A reducer is built at prepare time from the model's [`ParamLayout`] and the optimizer. It
//! owns its buffers, averages a completed window's gradients across the processes (and
//! unscales them for fp16), applies the update, and saves and loads its own state. The
//! accelerator, the prepared optimizer and checkpoints only call this trait, so a new engine
//! (NCCL on the device, MPI) is a new implementation, nothing more.
//!
//! Two implementations today:
//! - [`bucketed::BucketedReducer`]: Burn's optimizers; gradients averaged in buckets in visit
//!   order, optionally in half precision on the wire, narrowed on the device where it can.
//! - [`flat::FlatReducer`]: fused optimizers over flat buffers, with ZeRO-1.

pub(crate) mod api;
pub(crate) mod bucketed;
pub(crate) mod flat;
pub(crate) mod sharded;
pub(crate) mod sharded_files;
pub(crate) mod wire;

use std::sync::Arc;

use accelerate_core::AcceleratorConfig;
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;

use crate::error::AccelerateError;
use crate::fused::FusedOptimizer;
use crate::group::{Comm, Hybrid};
use crate::params::{self, ParamLayout, ParamList, ParamUpdate, Replacement};
pub(crate) use api::{
    GradientReducer, LoadSource, ModelUpdate, Outcome, ReducerKind, SaveRole, SavedFile,
    global_norm,
};
use bucketed::BucketedReducer;
pub(crate) use flat::{BucketGrad, ShardSink};
use flat::{FlatOptions, FlatReducer};
use sharded::ShardedReducer;

/// What [`Accelerator::backward`](crate::Accelerator::backward) returns: the gradients of a
/// completed accumulation window, averaged over the processes, or why there are none. Give it
/// to [`clip_grad_norm`](crate::Accelerator::clip_grad_norm) and then to the prepared
/// optimizer's [`step`](crate::PreparedOptimizer::step), which consumes it.
#[derive(Debug)]
pub struct Gradients {
    pub(crate) outcome: Outcome,
    /// The accumulation window it completed (windows counted from 1; 0 when it completed none).
    pub(crate) window: u64,
    /// The reducer that produced it.
    pub(crate) reducer: u64,
}

/// What a [`Gradients`] value holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradientsStatus {
    /// The micro-batch completed no accumulation window: the optimizer does not step.
    NotDue,
    /// Averaged gradients as Burn tensors (Burn's optimizer steps with them).
    Ready,
    /// Averaged gradients held in the fused optimizer's flat buffer.
    Held,
    /// The window's gradients overflowed (fp16): the step is skipped on every process.
    Skipped,
}

impl Gradients {
    pub(crate) fn new(outcome: Outcome, window: u64, reducer: u64) -> Self {
        Self {
            outcome,
            window,
            reducer,
        }
    }

    /// What this value holds.
    pub fn status(&self) -> GradientsStatus {
        match self.outcome {
            Outcome::NotDue => GradientsStatus::NotDue,
            Outcome::Skipped => GradientsStatus::Skipped,
            Outcome::Ready { .. } => GradientsStatus::Ready,
            Outcome::Held { .. } => GradientsStatus::Held,
        }
    }

    /// True when the optimizer steps with these gradients ([`Ready`](GradientsStatus::Ready)
    /// or [`Held`](GradientsStatus::Held)).
    pub fn is_due(&self) -> bool {
        matches!(self.outcome, Outcome::Ready { .. } | Outcome::Held { .. })
    }

    /// The averaged gradients as Burn's [`GradientsParams`] (a cheap copy that shares the
    /// tensors), when they are [`Ready`](GradientsStatus::Ready): to inspect them or to step
    /// an optimizer of your own.
    pub fn to_params(&self) -> Option<GradientsParams> {
        match &self.outcome {
            Outcome::Ready { grads, layout, .. } => Some(layout.to_grads(grads.clone())),
            _ => None,
        }
    }

    /// Clips so that the global L2 norm over every parameter is at most `max_norm`; returns
    /// the norm before clipping (`None` when there are no gradients to clip). Ready gradients
    /// are scaled on the device; held ones record the factor the fused update applies.
    pub(crate) fn clip(&mut self, max_norm: f32) -> Option<f32> {
        match &mut self.outcome {
            Outcome::NotDue | Outcome::Skipped => None,
            Outcome::Ready { grads, norm, .. } => {
                let current = match *norm {
                    Some(known) => known,
                    None => global_norm(grads)?,
                };
                let factor = accelerate_kernels::clip_coefficient(current, max_norm);
                // A NaN factor is applied too, so a poisoned step stays visible.
                if factor < 1.0 || factor.is_nan() {
                    for grad in grads.iter_mut().flatten() {
                        *grad = grad.clone().mul_scalar(factor);
                    }
                    // A second call sees the norm as clipped.
                    *norm = norm.map(|known| known * factor);
                }
                Some(current)
            }
            Outcome::Held { norm, clip_factor } => {
                // The norm as clipped so far, so that a second call sees what tensors would.
                let current = norm.value() * *clip_factor;
                let factor = accelerate_kernels::clip_coefficient(current, max_norm);
                if factor < 1.0 || factor.is_nan() {
                    *clip_factor *= factor;
                }
                Some(current)
            }
        }
    }
}

/// A model moving through a reducer's step.
pub(crate) struct ModelCell<M>(pub Option<M>);

impl<M: Module> ModelUpdate for ModelCell<M> {
    fn burn_step(
        &mut self,
        optim: &mut ModuleOptimizer,
        lr: ModuleLearningRate,
        grads: GradientsParams,
    ) {
        self.0 = self.0.take().map(|model| optim.step(lr, model, grads));
    }

    fn update_each(&mut self, update: &mut dyn ParamUpdate) {
        self.0 = self
            .0
            .take()
            .map(|model| params::update_each(model, update));
    }

    fn replace(&mut self, values: ParamList) {
        self.0 = self.0.take().map(|model| {
            params::replace(
                model,
                Replacement {
                    values,
                    ids: Vec::new(),
                },
            )
        });
    }
}

/// The optimizer a reducer is built for.
pub(crate) enum OptimizerChoice {
    /// Burn's optimizer (what `config.init()` returns).
    Burn(ModuleOptimizer),
    /// A fused optimizer over flat buffers.
    Fused(FusedOptimizer),
    /// None: gradients are averaged for an optimizer the user steps.
    None,
}

/// What a reducer is built from, besides the optimizer.
pub(crate) struct ReducerSpec {
    /// The prepared model's parameters.
    pub layout: Arc<ParamLayout>,
    /// Their values (visit order, flattened), for reducers that keep a master copy.
    pub values: Vec<Tensor<1>>,
    /// The accelerator's settings (bucket size, wire precision, ZeRO stage).
    pub config: AcceleratorConfig,
    pub rank: usize,
    pub world: usize,
    /// The backend runs our cubecl kernels on its tensors.
    pub device_kernels: bool,
    /// Per parameter (layout order): for a shard of a sharded unit (ZeRO-3), the elements of
    /// the whole parameter; `None` for a whole parameter.
    pub shards: Vec<Option<usize>>,
    /// Hybrid sharding's groups, when ZeRO's shards are cut within groups of the job.
    pub hybrid: Option<Hybrid>,
}

/// The reducer for `optimizer` on the model of `spec`: the one place that chooses an engine.
pub(crate) fn build(
    mut spec: ReducerSpec,
    optimizer: OptimizerChoice,
    comm: &Comm,
) -> Result<Box<dyn GradientReducer>, AccelerateError> {
    if spec.shards.iter().any(Option::is_some) {
        // ZeRO-3: the shards' gradients arrive averaged; the update is one process's.
        let shards = std::mem::take(&mut spec.shards);
        let (shard_comm, writes) = match spec.hybrid.take() {
            Some(hybrid) => (hybrid.shard.clone(), hybrid.writes_shards()),
            None => (comm.clone(), true),
        };
        let local = ShardedReducer::local_comm();
        spec.config.zero_stage = 0;
        spec.rank = 0;
        spec.world = 1;
        let inner = build(spec, optimizer, &local)?;
        return Ok(Box::new(ShardedReducer::new(
            inner, local, shards, shard_comm, writes,
        )));
    }
    let hybrid = spec.hybrid.take();
    let config = &spec.config;
    let burn_optimizer = match optimizer {
        OptimizerChoice::Fused(optimizer) => {
            let options = FlatOptions {
                zero_stage: config.zero_stage,
                rank: spec.rank,
                world: spec.world,
                device_kernels: spec.device_kernels,
                wire: config.gradient_communication,
                // Hybrid sharding's groups communicate on the host.
                device_collectives: comm.device_collectives().is_some() && hybrid.is_none(),
                hybrid,
            };
            let reducer = FlatReducer::new(spec.layout, spec.values, optimizer, options, comm)?;
            return Ok(Box::new(reducer));
        }
        OptimizerChoice::Burn(optimizer) => Some(optimizer),
        OptimizerChoice::None => None,
    };
    Ok(Box::new(BucketedReducer::new(
        spec.layout,
        burn_optimizer,
        config.gradient_bucket_bytes,
        config.gradient_communication,
        spec.device_kernels,
        comm.device_collectives().cloned(),
    )))
}
