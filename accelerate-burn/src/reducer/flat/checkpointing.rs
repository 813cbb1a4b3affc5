//! The fused reducer's part of a checkpoint: its state as a file stores it, the state put
//! back from the files of any world size, and its buffers rebuilt for a loaded model.

use std::sync::Arc;

use super::state_file::{FusedStateError, FusedStateFile};
use super::{Buffers, FlatPlan, FlatReducer};
use crate::reducer::api::LoadSource;
use crate::stage_error::StageError;

impl FlatReducer {
    /// This rank's state as a checkpoint stores it; state on the device is copied down.
    pub(super) fn state_file(&self) -> FusedStateFile {
        let buffers = match &self.buffers {
            Buffers::Host(host) => host.state.clone(),
            #[cfg(feature = "device-kernels")]
            Buffers::Device(device) => device.state_to_host(),
        };
        FusedStateFile {
            optimizer: self.optimizer.clone(),
            segments: self.plan.segments.clone(),
            len: self.plan.len,
            shard_start: self.plan.shard.start,
            times: self.plan.times.clone(),
            buffers: self
                .optimizer
                .buffer_names()
                .iter()
                .zip(buffers)
                .map(|(name, values)| (name.to_string(), values))
                .collect(),
        }
    }

    /// Fills this rank's shard of the state from the saved shards (of any world size).
    pub(super) fn apply_state(
        &mut self,
        files: Vec<FusedStateFile>,
    ) -> Result<(), FusedStateError> {
        for file in &files {
            if file.optimizer != self.optimizer {
                return Err(FusedStateError::OtherOptimizer {
                    saved: file.optimizer.clone(),
                    ours: self.optimizer.clone(),
                });
            }
            if file.segments != self.plan.segments || file.len != self.plan.len {
                return Err(FusedStateError::OtherParameters);
            }
            if file.times.len() != self.plan.times.len() {
                return Err(FusedStateError::StepCounts {
                    saved: file.times.len(),
                    ours: self.plan.times.len(),
                });
            }
        }
        if let Some(first) = files.first() {
            self.plan.times.clone_from(&first.times);
        }
        let mut state = Vec::new();
        for name in self.optimizer.buffer_names() {
            let mut full = vec![0.0f32; self.plan.padded.max(self.plan.len)];
            // Every element of the parameters must come from some shard: a gap would start
            // those parameters' moments from zero without a word.
            let mut covered = Vec::with_capacity(files.len());
            for file in &files {
                let values = file
                    .buffers
                    .get(*name)
                    .ok_or_else(|| FusedStateError::NoBuffer(name.to_string()))?;
                let end = file
                    .shard_start
                    .saturating_add(values.len())
                    .min(full.len());
                if file.shard_start < end {
                    full[file.shard_start..end].copy_from_slice(&values[..end - file.shard_start]);
                    covered.push(file.shard_start..end);
                }
            }
            covered.sort_by_key(|range| range.start);
            let reach = covered.iter().try_fold(0usize, |reach, range| {
                (range.start <= reach).then_some(reach.max(range.end))
            });
            if reach.is_none_or(|reach| reach < self.plan.len) {
                return Err(FusedStateError::Uncovered {
                    len: self.plan.len,
                    name: name.to_string(),
                });
            }
            state.push(full[self.plan.shard.clone()].to_vec());
        }
        match &mut self.buffers {
            Buffers::Host(host) => host.state = state,
            #[cfg(feature = "device-kernels")]
            Buffers::Device(device) => device.set_state(state),
        }
        Ok(())
    }

    /// New buffers for the model `source` loaded (its layout, ids and values); the buffers
    /// start again from it, under its (saved) parameter ids.
    pub(super) fn rebuild(&mut self, source: LoadSource<'_>) -> Result<(), StageError> {
        self.layout = Arc::new(source.layout);
        let (rank, world) = self.options.shard_job();
        self.plan = FlatPlan::new(&self.layout, self.sharding.splits(), rank, world);
        // The gradient buffer is kept (a new shared one would be a collective call here). It
        // is taken only once the new buffers are sure to be built, so a failed load does not
        // leave the current ones without it.
        let padded = self.plan.padded;
        let old = &mut self.buffers;
        let rebuilt = Self::buffers(
            &self.plan,
            source.values,
            &self.optimizer,
            self.sharding,
            &self.options,
            || {
                Ok(match old {
                    Buffers::Host(host) if host.grads_len() == padded => host.take_grads(),
                    _ => Self::local_grads(self.sharding, padded, self.options.world),
                })
            },
        )?;
        self.buffers = rebuilt;
        self.pending = None;
        Ok(())
    }
}
