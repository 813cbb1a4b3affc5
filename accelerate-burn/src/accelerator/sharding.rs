//! ZeRO-3's entry point: [`Accelerator::shard`] makes a model's units [`Sharded`], and the
//! checks that keep a sharded model out of paths that expect whole parameters.

use std::sync::Arc;

use accelerate_core::memory_estimate::MemoryEstimate;
use burn::module::Module;

use super::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;
use crate::params::{self, ParamLayout, ParamList};
use crate::sharded::{self, Sharded, WholeUnit};
use burn::tensor::Tensor;

impl<B: AcceleratorBackend> Accelerator<B> {
    /// Shards `unit` (a layer, a block) over the processes: ZeRO-3 (`zero_stage(3)`). This
    /// process keeps `1/N` of each of its float parameters (rank 0's values, so every process
    /// may build the unit with its own random initialization), and
    /// [`Sharded::gather_for`] gives the unit back whole, as a differentiable collective, inside
    /// the model's forward pass. Build the model from its units one at a time so that no more
    /// than one unit is ever whole beyond the shards:
    ///
    /// ```text
    /// let blocks = (0..layers).map(|_| acc.shard(block_config.init(&device))).collect::<Result<_, _>>()?;
    /// let model = Model { blocks, head: acc.shard(head_config.init(&device))? };
    /// let (model, optim, train) = acc.prepare((model, adamw, train))?;
    /// ```
    ///
    /// Every process must shard the same units in the same order. Gradients of shards arrive
    /// averaged from backward; parameters left whole are averaged as at any other stage.
    pub fn shard<M: Module>(&self, unit: M) -> Result<Sharded<M>, AccelerateError> {
        if self.config.zero_stage != 3 {
            return Err(AccelerateError::Misuse {
                rank: self.state.rank,
                what: format!("shard at zero_stage {}", self.config.zero_stage),
                hint: "sharded units are ZeRO-3: set zero_stage(3) (ACCELERATE_ZERO_STAGE=3, \
                       accelerate-rs launch --zero-stage 3)",
            });
        }
        if !B::SHARDED_UNITS {
            return Err(AccelerateError::BackendUnavailable {
                backend: B::NAME,
                reason: "sharded units (ZeRO-3) gather through an operation built for the flex, \
                         ndarray, wgpu and cuda backends only"
                    .into(),
                hint: "train with one of those, or use zero_stage 2 on this one",
            });
        }
        sharded::shard(unit, &self.shards, &self.device)
    }

    /// Marks `unit` (a layer, a block) as a unit of the model whose parameters stay whole on
    /// every process (ZeRO 0 to 2): in the forward pass, `unit.whole_for(&x).forward(x)` (the
    /// [`Unit`](crate::Unit) trait, as a sharded unit's), and backward hands the unit's
    /// gradients to a communication thread as soon as it has left the unit, so that averaging
    /// them overlaps the backward pass of the units before it
    /// ([`overlap_communication`](crate::AcceleratorBuilder::overlap_communication), on by
    /// default). Results are the same bits as without overlap.
    ///
    /// ```text
    /// let blocks = blocks.into_iter().map(|b| acc.unit(b)).collect::<Result<Vec<_>, _>>()?;
    /// ```
    ///
    /// Every process must mark the same units in the same order (rank 0's parameter ids are
    /// filed, a collective). A unit's parameters must reach the loss only through
    /// `whole_for`, once per forward pass: a tied weight used outside its unit, or a unit run
    /// twice, is an error of `backward` (keep it out of units). At `zero_stage(3)` use
    /// [`shard`](Self::shard).
    pub fn unit<M: Module>(&self, unit: M) -> Result<WholeUnit<M>, AccelerateError> {
        if self.config.zero_stage == 3 {
            return Err(AccelerateError::Misuse {
                rank: self.state.rank,
                what: "unit at zero_stage 3".into(),
                hint: "units of a ZeRO-3 model are sharded: use acc.shard(unit)",
            });
        }
        let unit = crate::params::adopt_device(unit, &self.device);
        let ids = ParamLayout::of(&unit).ids();
        let ids: Vec<u64> = if self.comm.is_distributed() {
            self.comm.lock().broadcast_object(Some(&ids), 0)?
        } else {
            ids
        };
        self.taps
            .register_unit(ids.into_iter().map(burn::module::ParamId::from));
        Ok(WholeUnit::new(unit, Arc::clone(&self.taps)))
    }

    /// Processes each of ZeRO's shards is cut across: the job's, or under hybrid sharding
    /// (`shard_group_size`) those of this process's shard group.
    pub fn shard_group_size(&self) -> usize {
        self.shards.shard_job().1
    }

    /// How this process reaches the others of its shard group: as
    /// [`transport`](Self::transport) says for the job, or under hybrid sharding by host
    /// `shm` (the shards' gathers stay on the host; only averaged shard gradients leave it).
    pub fn shard_transport(&self) -> &'static str {
        self.shards.comm().lock().transport()
    }

    /// Gradients of [`unit`](Self::unit)s handed to the communication thread from inside the
    /// backward pass so far (0 without overlap): to see that averaging overlapped backward.
    pub fn overlapped_gradients(&self) -> u64 {
        self.taps.handed()
    }

    /// All-gathers run by the sharded units so far, forward and backward (a unit gathered
    /// again in backward counts twice): to see what `reshard_after_forward` does.
    pub fn sharded_gathers(&self) -> u64 {
        self.shards.gathers()
    }

    /// What training `model` needs per process at each ZeRO stage (0 to 3) on this job's
    /// processes, with `state_buffers` optimizer buffers per parameter (AdamW 2, SGD with
    /// momentum 1): `accelerate-rs estimate-memory`'s figures for a model in hand, its sharded
    /// units' largest one counted at stage 3 (whole, with its gradients, while it runs).
    pub fn memory_estimates<M: Module>(
        &self,
        model: &M,
        state_buffers: u64,
    ) -> [MemoryEstimate; 4] {
        let layout = ParamLayout::of(model);
        let whole = self.shard_mask(&layout);
        let mut parameters = 0u64;
        let mut units: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
        for (entry, whole) in layout.entries.iter().zip(whole) {
            if !entry.trainable {
                continue;
            }
            let numel = whole.unwrap_or(entry.numel) as u64;
            parameters += numel;
            if let Some(unit) = self.shards.unit_of(entry.id) {
                *units.entry(unit).or_default() += numel;
            }
        }
        let largest = units.into_values().max().unwrap_or(0);
        // Under hybrid sharding a shard is cut across the shard group only.
        let world = self.shards.shard_job().1 as u64;
        [0u8, 1, 2, 3].map(|stage| {
            MemoryEstimate::new(parameters, state_buffers, world, stage).with_largest_unit(largest)
        })
    }

    /// For each parameter of `layout`, the elements of the whole parameter when it is a shard
    /// of a [`Sharded`] unit; `None` for a parameter left whole.
    pub(crate) fn shard_mask(&self, layout: &ParamLayout) -> Vec<Option<usize>> {
        self.shards.numels(layout)
    }

    /// Puts each shard gradient averaged across the replicas (hybrid sharding's thread) in
    /// `list` (of `layout`) in place of its shard group's average, which backward left there.
    pub(crate) fn take_replica_averages(
        &self,
        list: &mut ParamList,
        layout: &ParamLayout,
        averaged: crate::sharded::Averaged,
    ) -> Result<(), AccelerateError> {
        for (id, values) in averaged {
            let Some(index) = layout.entries.iter().position(|entry| entry.id == id) else {
                return Err(AccelerateError::ModelChanged {
                    rank: self.state.rank,
                    detail: format!(
                        "the gradient of shard {id} came back from the replicas, and the model \
                         has no such parameter"
                    ),
                });
            };
            let device = list[index]
                .as_ref()
                .map_or_else(|| self.device.clone(), Tensor::device);
            list[index] = Some(params::upload(values, &device));
        }
        Ok(())
    }

    /// At stage 3 the prepared model must hold sharded units; below it, none.
    pub(crate) fn check_sharding(&self, mask: &[Option<usize>]) -> Result<(), AccelerateError> {
        let any = mask.iter().any(Option::is_some);
        if self.config.zero_stage == 3 && !any {
            return Err(AccelerateError::Misuse {
                rank: self.state.rank,
                what: "zero_stage 3 with a model that has no sharded unit".into(),
                hint: "build the model's layers with acc.shard(layer) (see Accelerator::shard), \
                       or set zero_stage 2",
            });
        }
        Ok(())
    }

    /// The failure of a sharded unit's gather or reduce-scatter on any rank (a collective
    /// cannot fail inside a Burn operation; `backward` reports it). A rank whose shard or
    /// gradient could not be read took part with zeros, so its peers finished the pass too;
    /// here every rank learns of it and fails naming that rank and the cause, instead of
    /// training on the zeros. Only accelerators with sharded units exchange anything.
    pub(crate) fn sharding_failure(&self) -> Result<(), AccelerateError> {
        let mine = self.shards.error();
        if !self.shards.has_units() || matches!(mine, Some(AccelerateError::Comm(_))) {
            // A failed collective: the group refuses every later call, on every rank.
            return mine.map_or(Ok(()), Err);
        }
        // What crosses is the cause alone: the agreed error names the rank once.
        let cause = mine.map(|e| match e {
            AccelerateError::Tensor { detail, .. } => detail,
            other => other.to_string(),
        });
        match self.comm.agree(cause.map_or(Ok(()), Err))? {
            Ok(()) => Ok(()),
            Err(failures) => Err(AccelerateError::Tensor {
                rank: self.state.rank,
                op: "gathering or reduce-scattering a sharded parameter",
                detail: failures.to_string(),
            }),
        }
    }
}
