//! ZeRO-3's reducer. Gradients of shard parameters arrive from backward already averaged over
//! the processes (each gather's backward reduce-scatters), so this reducer communicates no
//! gradient of theirs: it averages the parameters left whole, measures the global norm and
//! the fp16 overflow over every rank's shards with one small all-reduce, and hands the update
//! to a reducer built as for one process (Burn's optimizer or the fused one), which updates
//! this rank's shards as if they were whole parameters (every optimizer of ours and Burn's is
//! elementwise).

use std::collections::HashMap;
use std::sync::Arc;

use accelerate_core::{ProcessGroup, Reduction};
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::ModuleOptimizer;

use super::api::{
    GradientReducer, HeldNorm, LoadSource, ModelUpdate, Outcome, Reduced, ReducerKind, SaveRole,
    SavedFile, unscaled_norm,
};
use super::sharded_files;
use crate::error::AccelerateError;
use crate::fused::HeldBytes;
use crate::group::Comm;
use crate::params::{self, ParamLayout, ParamList};
use crate::stage_error::StageError;

/// Wraps a one-process reducer over a model holding sharded units.
pub(crate) struct ShardedReducer {
    inner: Box<dyn GradientReducer>,
    /// A group of one: what the inner reducer communicates with (nothing).
    local: Comm,
    /// Per parameter (layout order): the whole parameter's elements for a shard of a sharded
    /// unit, `None` for a parameter left whole.
    shards: Vec<Option<usize>>,
    /// The processes a shard is cut across: the job, or under hybrid sharding this
    /// process's shard group.
    shard_comm: Comm,
    /// Whether this process writes its shards in a checkpoint (under hybrid sharding, the
    /// first shard group's only: the others hold the same).
    writes: bool,
}

impl ShardedReducer {
    /// `inner` must have been built for one process over `local`; `shard_comm` is what the
    /// shards are cut across (the job, or the shard group under hybrid sharding), `writes`
    /// whether this process saves them.
    pub fn new(
        inner: Box<dyn GradientReducer>,
        local: Comm,
        shards: Vec<Option<usize>>,
        shard_comm: Comm,
        writes: bool,
    ) -> Self {
        Self {
            inner,
            local,
            shards,
            shard_comm,
            writes,
        }
    }

    /// This process's rank among the processes a shard is cut across, and how many they are.
    fn shard_job(&self) -> (usize, usize) {
        (self.shard_comm.rank(), self.shard_comm.world_size())
    }

    /// A group of one for the inner reducer.
    pub fn local_comm() -> Comm {
        Comm::new(ProcessGroup::single())
    }

    /// Averages the gradients of the parameters left whole over the processes, on the host.
    fn average_whole(&self, grads: &mut ParamList, comm: &Comm) -> Result<(), AccelerateError> {
        let whole: Vec<usize> = (0..grads.len())
            .filter(|&i| self.shards[i].is_none() && grads[i].is_some())
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

    /// The sum of squares of every rank's shard gradients plus the whole ones', in f64 on the
    /// host (the shards' sum crosses as two f32 words, its value and its rounding error): as
    /// precise as the unsharded reducers' sum, so that the norm rounds to the same f32 and
    /// clipping scales as it does at the other stages. Summed over the shard group: under
    /// hybrid sharding the other groups hold the same averaged shards.
    fn global_sum_of_squares(&self, grads: &ParamList) -> Result<f64, AccelerateError> {
        let sum = |shard: bool| -> f64 {
            grads
                .iter()
                .zip(&self.shards)
                .filter(|(_, numel)| numel.is_some() == shard)
                .filter_map(|(grad, _)| grad.clone())
                .map(|grad| accelerate_kernels::sum_of_squares(&params::to_host_f32(grad)))
                .sum()
        };
        let (shards, whole) = (sum(true), sum(false));
        let high = shards as f32;
        let mut words = [high, (shards - f64::from(high)) as f32];
        self.shard_comm
            .timed(|group| group.all_reduce(&mut words, Reduction::Sum))?;
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
        let sum_sq = self.global_sum_of_squares(&grads)?;
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

    /// Every rank saves its shards' optimizer state (the model's shards are saved beside it
    /// by the checkpoint, which holds the model), named by its rank in the shard group; under
    /// hybrid sharding the first shard group's ranks only.
    fn save(&mut self, role: SaveRole) -> Result<Vec<SavedFile>, StageError> {
        if !self.writes {
            return Ok(Vec::new());
        }
        let role = SaveRole {
            rank: self.shard_comm.rank(),
            ..role
        };
        let own = SaveRole {
            main: true,
            distributed: false,
            ..role
        };
        let burn_record = self.inner.kind() != ReducerKind::Fused;
        let mut files = self.inner.save(own)?;
        for file in &mut files {
            file.rank = Some(role.rank);
            if burn_record {
                // Burn's record of this rank's shards, in a directory of the rank's own.
                let sub = sharded_files::burn_record_dir(role.rank);
                file.name = format!("{sub}/{}", file.name);
                file.contents = "one rank's Burn optimizer record over its ZeRO-3 shards";
            } else {
                file.name = sharded_files::state_file_name(role.rank);
                file.contents = "one rank's fused optimizer state over its ZeRO-3 shards";
            }
        }
        Ok(files)
    }

    /// The optimizer state over this job's shards, put together from the saved ranks' (of
    /// any number).
    fn load(&mut self, source: LoadSource<'_>) -> Result<(), StageError> {
        if self.inner.kind() != ReducerKind::Fused {
            // Burn's record is keyed to this rank's shards: the same ranks only.
            let (rank, world) = self.shard_job();
            let saved = sharded_files::burn_record_ranks(source.files);
            if saved != world {
                return Err(burn_optimizer_checkpoint(rank, saved, world));
            }
            let dir = source.dir.join(sharded_files::burn_record_dir(rank));
            return self.inner.load(LoadSource {
                dir: &dir,
                ..source
            });
        }
        let whole: HashMap<u64, usize> = source
            .layout
            .entries
            .iter()
            .zip(&self.shards)
            .filter_map(|(entry, numel)| Some((entry.id.val(), (*numel)?)))
            .collect();
        let (dir, files) = (source.dir, source.files);
        let job = self.shard_job();
        self.inner.load_resharded(source, &mut |segments| {
            sharded_files::reshard_state(
                dir,
                files,
                segments,
                &|segment| whole.get(&segment.id).copied(),
                job,
            )
        })
    }

    fn shard_numels(&self) -> Option<&[Option<usize>]> {
        Some(&self.shards)
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

fn burn_optimizer_checkpoint(rank: usize, saved: usize, world: usize) -> StageError {
    StageError::from(AccelerateError::Misuse {
        rank,
        what: format!(
            "Burn's optimizer state of sharded units (ZeRO-3) saved by {saved} processes, \
             loaded by {world}"
        ),
        hint: "Burn's records hold each rank's shards as they were cut and cannot be cut \
               again: resume on as many processes, or train with a fused optimizer (Burn's \
               AdamW/Adam/SGD config), whose state is resharded",
    })
}
