//! The check before the optimizer's buffers exist: on a CPU backend whose process has a memory
//! limit (a resource limit or a cgroup), a model whose training cannot fit under it at this
//! ZeRO stage stops at prepare with an error that says what it needs and what would fit,
//! instead of failing an allocation in the middle of a step.

use accelerate_core::memory_estimate::MemoryEstimate;
use accelerate_core::memory_limit::process_memory_limit;

use super::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;
use crate::reducer::ReducerSpec;

impl<B: AcceleratorBackend> Accelerator<B> {
    /// Fails when training the model of `spec` needs more than this process may use.
    /// `state_buffers` is the fused optimizer's buffers per parameter; `None` for Burn's
    /// optimizer, whose own buffers are not counted (the estimate stays a lower bound).
    pub(crate) fn check_memory(
        &self,
        spec: &ReducerSpec,
        state_buffers: Option<u64>,
    ) -> Result<(), AccelerateError> {
        // The GPU backends keep the model and its buffers in device memory.
        if B::DEVICE_KERNELS {
            return Ok(());
        }
        let Some(limit) = process_memory_limit() else {
            return Ok(());
        };
        let parameters: u64 = spec
            .layout
            .entries
            .iter()
            .zip(&spec.shards)
            .filter(|(entry, _)| entry.trainable)
            .map(|(entry, whole)| whole.unwrap_or(entry.numel) as u64)
            .sum();
        let world = self.state.world_size as u64;
        // A background save's snapshot in memory is held while training goes on.
        let snapshot = self.config.async_checkpoints
            && self.checkpoints.snapshot == crate::CheckpointSnapshot::Memory;
        let needed =
            |stage: u8, world: u64| needed(parameters, state_buffers, world, stage, snapshot);
        let stage = self.config.zero_stage;
        let need = needed(stage, world);
        if need <= limit.bytes {
            return Ok(());
        }
        let fits = (stage + 1..=3).find(|&s| needed(s, world) <= limit.bytes);
        let hint = match fits {
            Some(3) => format!(
                "at zero_stage 3 with the model's layers sharded (Accelerator::shard) it needs \
                 about {}",
                mib(needed(3, world))
            ),
            Some(s) => format!("at zero_stage {s} it needs about {}", mib(needed(s, world))),
            None => format!(
                "even at zero_stage 3 it needs about {} here; with {} processes, about {}",
                mib(needed(3, world)),
                2 * world,
                mib(needed(3, 2 * world))
            ),
        };
        Err(AccelerateError::OutOfMemory {
            rank: self.state.rank,
            detail: format!(
                "training {parameters} parameters at zero_stage {stage} on {world} process{} \
                 needs about {} per process, and this one may use {} ({})",
                if world == 1 { "" } else { "es" },
                mib(need),
                mib(limit.bytes),
                limit.source,
            ),
            hint,
        })
    }
}

/// Bytes one process needs at `stage` over `world` processes: what `estimate-memory` says
/// for the fused optimizer's host path; for Burn's optimizer the model and its gradients
/// (and with a background save's `snapshot`, its copy of the model).
fn needed(
    parameters: u64,
    state_buffers: Option<u64>,
    world: u64,
    stage: u8,
    snapshot: bool,
) -> u64 {
    let mut estimate = MemoryEstimate::new(parameters, state_buffers.unwrap_or(0), world, stage);
    if snapshot {
        estimate = estimate.with_async_checkpoints();
    }
    match state_buffers {
        Some(_) => estimate.peak(),
        None => estimate
            .model_parameters
            .saturating_add(estimate.backward_gradients)
            .saturating_add(estimate.checkpoint_snapshot),
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
}
