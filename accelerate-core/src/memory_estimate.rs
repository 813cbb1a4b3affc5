//! What a fused optimizer's training holds per process at each ZeRO stage, computed from a
//! parameter count (or a safetensors file's header), before anything is allocated: the
//! arithmetic behind `accelerate-rs estimate-memory`.
//!
//! The figures follow the buffers the fused optimizer really keeps on the host path (the CPU
//! backends, and every backend under ZeRO-2), per process, with P trainable f32 parameters
//! padded to a multiple of the N processes and S state buffers per parameter (AdamW 2, with
//! AMSGrad 3, SGD with momentum 1):
//!
//! | stage | model | master copy | gradients kept | optimizer state |
//! |---|---|---|---|---|
//! | 0 | 4P | none | 4P (none on one process) | 4SP |
//! | 1 | 4P | none | none | 4SP/N |
//! | 2 | 4P | none | 4P/N (with accumulation) | 4SP/N |
//! | 3 | 4P/N | none | none | 4SP/N |
//!
//! On the CPU backends the model's own f32 parameters are the master copy: the update reads
//! and writes them one parameter at a time (at stages 1 and 2 each process its part, broadcast
//! to the others), so `master_parameters` is 0 here. A model on a GPU backend at stage 1 or 2
//! (the host path) keeps this process's f32 master shard in host memory (4P/N), and a model
//! with parameters in another dtype an f32 copy (4P, or 4P/N under ZeRO).
//! Burn's backward pass also returns every gradient at once (4P for a moment, in
//! [`MemoryEstimate::backward_gradients`]; at stage 3 only the shards' gradients, 4P/N): at
//! stages 1 and 2 they are reduce-scattered where they are (each process's shard averaged in
//! backward's own tensors, the rest let go), on one process and at stage 3 updated from
//! there, with no flat copy. Stages 1 and 2 differ within an accumulation window: stage 1
//! keeps the window's whole sum, as Burn tensors, and sends it once; stage 2 sends each
//! micro-batch and keeps the shard of the sum, in a buffer of the shard's length that the
//! first window of several micro-batches makes and later ones reuse (counted here; a run
//! without accumulation holds what stage 1 holds).
//! A model whose layers are units (`Accelerator::unit`) hands each unit's gradients over as
//! backward leaves it: at stage 2 they are reduce-scattered into the shard then (its buffer,
//! 4P/N, kept from the first step), and backward holds one unit's gradients at a time instead
//! of every one; this estimate still counts 4P for backward, the bound for models without units.
//! Checkpoints saved in the background (`async_checkpoints`) hold a snapshot of what the main
//! process writes while training goes on: its model (4P, or 4P/N at stage 3) and its part of
//! the optimizer state, counted in the peak ([`MemoryEstimate::checkpoint_snapshot`]).
//! Activations come on top and depend on the batch. At stage 3 each sharded unit is whole
//! while it runs, its parameters and, in backward, their gradient (8 bytes per parameter of
//! the largest unit on top); each parameter is cut on its own, so its shard is padded to whole
//! elements (at most one element per parameter more than P/N).
//!
//! ```
//! use accelerate_core::memory_estimate::MemoryEstimate;
//!
//! // 1 M parameters, AdamW (2 state buffers), 4 processes.
//! let zero2 = MemoryEstimate::new(1_000_000, 2, 4, 2);
//! assert_eq!(zero2.optimizer_state, 2_000_000); // 8 bytes per parameter over 4 processes
//! assert_eq!(zero2.gradients, 1_000_000);
//! assert_eq!(zero2.held(), 4_000_000 + 1_000_000 + 2_000_000); // model, gradients, state
//! // Saved in the background: the main process's snapshot (model and its state shard).
//! let saving = zero2.with_async_checkpoints();
//! assert_eq!(saving.checkpoint_snapshot, 4_000_000 + 2_000_000);
//! assert_eq!(saving.peak(), zero2.peak() + 6_000_000);
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use crate::weights::{self, ShardIndex, WeightsError};

/// Bytes of an f32 value.
const F32: u64 = 4;

/// What one process holds for training at one ZeRO stage, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// The ZeRO stage (0 to 3).
    pub stage: u8,
    /// The model's own f32 parameters (whole on every process; the shards at stage 3).
    pub model_parameters: u64,
    /// The fused optimizer's f32 master copy: none (the model's f32 parameters are updated in
    /// place); kept for models whose parameters are in another dtype, which this estimate
    /// does not describe.
    pub master_parameters: u64,
    /// Gradient buffers kept from step to step.
    pub gradients: u64,
    /// Optimizer state (moments, velocity).
    pub optimizer_state: u64,
    /// Every gradient at once, as Burn's backward pass returns them (for a moment, at the end
    /// of each backward pass; Burn has no per-parameter hooks to hand them over sooner).
    pub backward_gradients: u64,
    /// At stage 3, the largest sharded unit while it runs: its gathered parameters and their
    /// gradients, 8 bytes a parameter ([`with_largest_unit`](Self::with_largest_unit)); 0
    /// at the other stages, or when the units are not known.
    pub largest_unit: u64,
    /// With checkpoints saved in the background, the snapshot the main process holds while
    /// its files are written: the model as it writes it (whole, or its shards at stage 3)
    /// and its part of the optimizer state ([`with_async_checkpoints`](Self::with_async_checkpoints));
    /// 0 for synchronous saves.
    pub checkpoint_snapshot: u64,
}

impl MemoryEstimate {
    /// The estimate for `parameters` trainable f32 values with `state_buffers` optimizer
    /// buffers each, at ZeRO `stage` (stages above 3 are counted as 3) over `world`
    /// processes (at least 1). One process shards nothing, whatever the stage.
    pub fn new(parameters: u64, state_buffers: u64, world: u64, stage: u8) -> Self {
        let world = world.max(1);
        let stage = if world == 1 { 0 } else { stage.min(3) };
        let whole = parameters.saturating_mul(F32);
        let shard = parameters.div_ceil(world).saturating_mul(F32);
        // Without ZeRO, several processes all-reduce a flat gradient buffer; one process
        // updates from backward's own gradients.
        let (master, gradients, state_elements) = match stage {
            0 if world > 1 => (0, whole, whole),
            0 => (0, 0, whole),
            // ZeRO-1 averages this rank's shard inside backward's own gradients; ZeRO-2 keeps
            // a buffer of the shard's length for a window of several micro-batches.
            1 => (0, 0, shard),
            2 => (0, shard, shard),
            _ => (0, 0, shard),
        };
        // ZeRO-3: the model holds its shards, and backward returns their gradients.
        let model = if stage == 3 { shard } else { whole };
        Self {
            stage,
            model_parameters: model,
            master_parameters: master,
            gradients,
            optimizer_state: state_elements.saturating_mul(state_buffers),
            backward_gradients: model,
            largest_unit: 0,
            checkpoint_snapshot: 0,
        }
    }

    /// This estimate with checkpoints saved in the background from a snapshot in memory:
    /// the main process holds a copy of what it writes (the model, its part of the optimizer
    /// state) until the write ends, while training goes on.
    pub fn with_async_checkpoints(mut self) -> Self {
        self.checkpoint_snapshot = self.model_parameters.saturating_add(self.optimizer_state);
        self
    }

    /// This estimate with the largest sharded unit, of `parameters` f32 parameters, whole
    /// while it runs (counted at stage 3 only: below it nothing is gathered).
    pub fn with_largest_unit(mut self, parameters: u64) -> Self {
        if self.stage == 3 {
            self.largest_unit = parameters.saturating_mul(2 * F32);
        }
        self
    }

    /// Everything kept between steps: model, master copy, gradients and optimizer state.
    pub fn held(&self) -> u64 {
        self.model_parameters
            .saturating_add(self.master_parameters)
            .saturating_add(self.gradients)
            .saturating_add(self.optimizer_state)
    }

    /// The peak over a step, activations aside: what is held plus the gradients of one
    /// backward pass (and at stage 3 the largest unit, gathered with its gradients, and a
    /// background save's snapshot).
    pub fn peak(&self) -> u64 {
        self.held()
            .saturating_add(self.backward_gradients)
            .saturating_add(self.largest_unit)
            .saturating_add(self.checkpoint_snapshot)
    }
}

/// Elements of each dtype in a safetensors file, read from its header only.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SafetensorsCounts {
    /// Elements per dtype (`F32`, `BF16`, `I64`, ...), as the header names them.
    pub elements: BTreeMap<String, u64>,
    /// Tensors in the file.
    pub tensors: usize,
    /// The largest unit ZeRO-3 would shard, and its floating-point elements: every numbered
    /// block of the names (`model.layers.12.*` is the unit `model.layers.12`) is one, every
    /// other tensor a unit of its own.
    pub largest_unit: Option<(String, u64)>,
}

impl SafetensorsCounts {
    /// Elements of floating-point tensors: what a model trains (integer tensors are buffers
    /// such as token positions).
    pub fn float_elements(&self) -> u64 {
        self.elements
            .iter()
            .filter(|(dtype, _)| dtype.starts_with('F') || dtype.starts_with("BF"))
            .map(|(_, n)| n)
            .fold(0u64, |sum, n| sum.saturating_add(*n))
    }
}

/// Counts the elements of every tensor of a model's weights, reading only safetensors
/// headers, never the data: `path` is a safetensors file, or a directory holding a sharded
/// model (`model.safetensors.index.json` and its shards) or a `model.safetensors`.
pub fn count_safetensors(path: &Path) -> Result<SafetensorsCounts, WeightsError> {
    let files = if path.is_dir() {
        if path.join(weights::INDEX_FILE).is_file() {
            let index = ShardIndex::read(path)?;
            index.files().into_iter().map(|f| path.join(f)).collect()
        } else {
            vec![path.join(weights::MODEL_FILE)]
        }
    } else {
        vec![path.to_path_buf()]
    };
    let mut counts = SafetensorsCounts::default();
    let mut units: BTreeMap<String, u64> = BTreeMap::new();
    for file in files {
        for (name, entry) in weights::read_header(&file)?.tensors {
            let elements = entry.elements().unwrap_or(u64::MAX);
            if entry.dtype.starts_with('F') || entry.dtype.starts_with("BF") {
                let unit = units.entry(unit_of(&name).to_string()).or_default();
                *unit = unit.saturating_add(elements);
            }
            let total = counts.elements.entry(entry.dtype).or_default();
            *total = total.saturating_add(elements);
            counts.tensors += 1;
        }
    }
    counts.largest_unit = units.into_iter().max_by_key(|(_, elements)| *elements);
    Ok(counts)
}

/// The unit a tensor named `name` belongs to: its name up to its first numbered component
/// (`model.layers.12.mlp.weight` -> `model.layers.12`), or the whole name without one.
fn unit_of(name: &str) -> &str {
    let mut end = 0;
    for part in name.split('.') {
        end += part.len();
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            return &name[..end];
        }
        end += 1;
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::write_test_file as write_safetensors;

    #[test]
    fn stages_hold_what_the_table_says() {
        // 10 parameters over 4 processes: shards of 3, padded to 12.
        let [zero0, zero1, zero2] = [0, 1, 2].map(|s| MemoryEstimate::new(10, 2, 4, s));
        assert_eq!(
            (
                zero0.master_parameters,
                zero0.gradients,
                zero0.optimizer_state
            ),
            (0, 40, 80)
        );
        assert_eq!(
            (
                zero1.master_parameters,
                zero1.gradients,
                zero1.optimizer_state
            ),
            (0, 0, 24)
        );
        assert_eq!(
            (
                zero2.master_parameters,
                zero2.gradients,
                zero2.optimizer_state
            ),
            (0, 12, 24)
        );
        assert_eq!(zero2.held(), zero1.held() + 12);
        assert!(zero1.held() < zero0.held());
        assert_eq!(zero2.peak(), zero2.held() + 40);
        // ZeRO-3: the model itself is its shards, and so are backward's gradients.
        let zero3 = MemoryEstimate::new(10, 2, 4, 3);
        assert_eq!((zero3.model_parameters, zero3.backward_gradients), (12, 12));
        assert_eq!(zero3.held(), 12 + 24);
        assert_eq!(MemoryEstimate::new(10, 2, 4, 9), zero3);
        // A unit of 5 parameters is whole while it runs, with its gradients: 40 bytes, at
        // stage 3 only.
        assert_eq!(zero3.with_largest_unit(5).peak(), zero3.peak() + 40);
        assert_eq!(zero2.with_largest_unit(5), zero2);
        // One process shards nothing.
        assert_eq!(
            MemoryEstimate::new(10, 2, 1, 2),
            MemoryEstimate::new(10, 2, 1, 0)
        );
    }

    #[test]
    fn a_safetensors_header_is_counted_without_reading_the_data() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("model.safetensors");
        write_safetensors(
            &path,
            r#"{"__metadata__":{"format":"pt"},
                "w":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]},
                "b":{"dtype":"BF16","shape":[4],"data_offsets":[48,56]},
                "pos":{"dtype":"I64","shape":[2],"data_offsets":[56,72]}}"#,
            72,
        );
        let counts = count_safetensors(&path).unwrap();
        assert_eq!(counts.tensors, 3);
        assert_eq!(counts.float_elements(), 16);
        assert_eq!(counts.elements["I64"], 2);

        std::fs::write(&path, u64::MAX.to_le_bytes()).unwrap();
        let err = count_safetensors(&path).unwrap_err().to_string();
        assert!(err.contains("more than safetensors allows"), "{err}");
        write_safetensors(&path, "[1, 2]", 0);
        let err = count_safetensors(&path).unwrap_err().to_string();
        assert!(err.contains("not safetensors' JSON"), "{err}");
    }

    #[test]
    fn a_sharded_model_is_counted_over_its_shards() {
        let tmp = tempfile::tempdir().unwrap();
        let shard = |i: usize| weights::shard_file_name(i, 2);
        write_safetensors(
            &tmp.path().join(shard(0)),
            r#"{"w":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]}}"#,
            48,
        );
        write_safetensors(
            &tmp.path().join(shard(1)),
            r#"{"b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
            16,
        );
        ShardIndex::new(
            64,
            [("w".to_string(), shard(0)), ("b".to_string(), shard(1))],
        )
        .write(tmp.path())
        .unwrap();
        let counts = count_safetensors(tmp.path()).unwrap();
        assert_eq!((counts.tensors, counts.float_elements()), (2, 16));
    }

    #[test]
    fn units_are_the_numbered_blocks_of_the_names() {
        assert_eq!(
            unit_of("model.layers.12.mlp.up_proj.weight"),
            "model.layers.12"
        );
        assert_eq!(unit_of("layers.0.weight"), "layers.0");
        assert_eq!(unit_of("lm_head.weight"), "lm_head.weight");
        assert_eq!(unit_of("h.1x.weight"), "h.1x.weight");

        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("model.safetensors");
        write_safetensors(
            &path,
            r#"{"layers.0.w":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]},
                "layers.0.b":{"dtype":"F32","shape":[4],"data_offsets":[48,64]},
                "layers.1.w":{"dtype":"F32","shape":[2,3],"data_offsets":[64,88]},
                "head":{"dtype":"F32","shape":[5],"data_offsets":[88,108]}}"#,
            108,
        );
        let counts = count_safetensors(&path).unwrap();
        assert_eq!(counts.largest_unit, Some(("layers.0".to_string(), 16)));
    }
}
