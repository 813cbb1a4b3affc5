//! ZeRO-3's reducer. Gradients of shard parameters arrive from backward already averaged over
//! the processes (each gather's backward reduce-scatters), so this reducer communicates no
//! gradient of theirs: it averages the parameters left whole, measures the global norm and
//! the fp16 overflow over every rank's shards with one small all-reduce, and hands the update
//! to a reducer built as for one process (Burn's optimizer or the fused one), which updates
//! this rank's shards as if they were whole parameters (every optimizer of ours and Burn's is
//! elementwise).

use std::path::Path;
use std::sync::Arc;

use accelerate_core::{ProcessGroup, Reduction};
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::ModuleOptimizer;
use burn::tensor::Tensor;

use super::api::{
    GradientReducer, HeldNorm, LoadSource, ModelUpdate, Outcome, Reduced, ReducerKind, SaveRole,
    SavedFile, sum_of_squares_on_device, unscaled_norm,
};
use crate::checkpoint::StageError;
use crate::error::AccelerateError;
use crate::fused::HeldBytes;
use crate::group::Comm;
use crate::params::{self, ParamLayout, ParamList};

/// Wraps a one-process reducer over a model holding sharded units.
pub(crate) struct ShardedReducer {
    inner: Box<dyn GradientReducer>,
    /// A group of one: what the inner reducer communicates with (nothing).
    local: Comm,
    /// Per parameter (layout order): true for a shard of a sharded unit.
    shards: Vec<bool>,
    /// This process's rank in the job.
    rank: usize,
}

impl ShardedReducer {
    /// `inner` must have been built for one process over `local`.
    pub fn new(
        inner: Box<dyn GradientReducer>,
        local: Comm,
        shards: Vec<bool>,
        rank: usize,
    ) -> Self {
        Self {
            inner,
            local,
            shards,
            rank,
        }
    }

    /// A group of one for the inner reducer.
    pub fn local_comm() -> Comm {
        Comm::new(ProcessGroup::single())
    }

    /// Averages the gradients of the parameters left whole over the processes, on the host.
    fn average_whole(&self, grads: &mut ParamList, comm: &Comm) -> Result<(), AccelerateError> {
        let whole: Vec<usize> = (0..grads.len())
            .filter(|&i| !self.shards[i] && grads[i].is_some())
            .collect();
        if whole.is_empty() {
            return Ok(());
        }
        let mut flat = Vec::new();
        let mut lens = Vec::with_capacity(whole.len());
        let mut device = None;
        for &i in &whole {
            if let Some(grad) = grads[i].take() {
                device.get_or_insert_with(|| grad.device());
                let values = params::to_host_f32(grad);
                lens.push(values.len());
                flat.extend(values);
            }
        }
        comm.timed(|group| group.all_reduce(&mut flat, Reduction::Mean))?;
        let device = device.unwrap_or_default();
        let mut offset = 0;
        for (&i, len) in whole.iter().zip(lens) {
            grads[i] = Some(params::upload(flat[offset..offset + len].to_vec(), &device));
            offset += len;
        }
        Ok(())
    }

    /// The sum of squares of every rank's shard gradients plus the whole ones', in f64 (the
    /// shards' sum crosses as two f32 words, its value and its rounding error).
    fn global_sum_of_squares(
        &self,
        grads: &ParamList,
        comm: &Comm,
    ) -> Result<f64, AccelerateError> {
        let parts = |shard: bool| -> Vec<Tensor<1>> {
            grads
                .iter()
                .zip(&self.shards)
                .filter(|(_, is_shard)| **is_shard == shard)
                .filter_map(|(grad, _)| grad.clone())
                .collect()
        };
        let shards = sum_of_squares_on_device(&parts(true));
        let whole = sum_of_squares_on_device(&parts(false));
        let high = shards as f32;
        let mut words = [high, (shards - f64::from(high)) as f32];
        comm.timed(|group| group.all_reduce(&mut words, Reduction::Sum))?;
        Ok(f64::from(words[0]) + f64::from(words[1]) + whole)
    }
}

impl GradientReducer for ShardedReducer {
    fn kind(&self) -> ReducerKind {
        self.inner.kind()
    }

    fn layout(&self) -> &Arc<ParamLayout> {
        self.inner.layout()
    }

    fn reduce(
        &mut self,
        mut grads: ParamList,
        comm: &Comm,
        inv_scale: Option<f32>,
    ) -> Result<Reduced, AccelerateError> {
        if !comm.is_distributed() {
            // One process: the shards are whole and the inner reducer's norm is the global one.
            return self.inner.reduce(grads, &self.local, inv_scale);
        }
        self.average_whole(&mut grads, comm)?;
        let sum_sq = self.global_sum_of_squares(&grads, comm)?;
        // Every rank sees the same sum: an infinite or NaN gradient on any rank makes it so.
        let overflow = inv_scale.is_some() && !sum_sq.is_finite();
        let norm = unscaled_norm(sum_sq, inv_scale.unwrap_or(1.0));
        let mut reduced = self.inner.reduce(grads, &self.local, inv_scale)?;
        reduced.overflow = overflow;
        reduced.outcome = match reduced.outcome {
            Outcome::Held { clip_factor, .. } => Outcome::Held {
                norm: HeldNorm::Known(norm),
                clip_factor,
            },
            Outcome::Ready { grads, layout, .. } => Outcome::Ready {
                grads,
                layout,
                norm: Some(norm),
            },
            other => other,
        };
        Ok(reduced)
    }

    fn discard(&mut self) {
        self.inner.discard();
    }

    fn step(
        &mut self,
        lr: ModuleLearningRate,
        outcome: Outcome,
        model: &mut dyn ModelUpdate,
        _comm: &Comm,
    ) -> Result<(), AccelerateError> {
        self.inner.step(lr, outcome, model, &self.local)
    }

    fn save(&mut self, _dir: &Path, role: SaveRole) -> Result<Vec<SavedFile>, StageError> {
        Err(unsupported_checkpoint(role.rank))
    }

    fn load(&mut self, _source: LoadSource<'_>) -> Result<(), StageError> {
        Err(unsupported_checkpoint(self.rank))
    }

    fn state_on_device(&self) -> Option<bool> {
        self.inner.state_on_device()
    }

    fn held_bytes(&self) -> Option<HeldBytes> {
        self.inner.held_bytes()
    }

    fn burn_optimizer(&self) -> Option<&ModuleOptimizer> {
        self.inner.burn_optimizer()
    }

    fn burn_optimizer_mut(&mut self) -> Option<&mut ModuleOptimizer> {
        self.inner.burn_optimizer_mut()
    }
}

fn unsupported_checkpoint(rank: usize) -> StageError {
    StageError::from(AccelerateError::Misuse {
        rank,
        what: "a checkpoint of a model with sharded units (ZeRO-3)".into(),
        hint: "checkpoints of sharded units are not written yet: train at zero_stage 2 to save \
               and resume",
    })
}
