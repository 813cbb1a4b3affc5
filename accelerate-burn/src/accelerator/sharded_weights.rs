//! `save_model` and `save_model_sharded` for a model with sharded units (ZeRO-3): the main
//! process writes the files plain Burn and the hub read, every process taking part in one
//! all-gather per sharded parameter, in order, so that one parameter at a time is whole (on
//! the main process, in the file's write buffer) and never the model.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use accelerate_core::CommError;
use accelerate_core::weights::{
    self, INDEX_FILE, SAVED_BY, SAVED_BY_KEY, ShardIndex, ShardedSave, StreamedTensor,
    WeightsError, WholeSave,
};
use burn::module::Module;

use super::{Accelerator, MODEL_FILE};
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;
use crate::params::{self, ParamLayout};

impl<B: AcceleratorBackend> Accelerator<B> {
    /// True when `model` holds sharded units.
    pub(crate) fn has_sharded_units<M: Module>(&self, model: &M) -> bool {
        self.shard_mask(&ParamLayout::of(model))
            .iter()
            .any(Option::is_some)
    }

    /// Writes a model with sharded units into `dir`: one `model.safetensors`, or the hub's
    /// shards of at most `max_shard_size` bytes and their index. Every process must call it.
    pub(crate) fn save_sharded_units<M: Module>(
        &self,
        model: &M,
        dir: &Path,
        max_shard_size: Option<u64>,
    ) -> Result<Vec<PathBuf>, AccelerateError> {
        let layout = ParamLayout::of(model);
        let whole: Vec<Option<Vec<usize>>> = layout
            .entries
            .iter()
            .map(|entry| self.shards.whole_shape(entry.id))
            .collect();
        let tensors: Vec<StreamedTensor> = layout
            .entries
            .iter()
            .zip(&whole)
            .map(|(entry, shape)| StreamedTensor {
                name: entry.path.clone(),
                dtype: "F32".into(),
                shape: shape
                    .as_ref()
                    .unwrap_or(&entry.shape)
                    .iter()
                    .map(|&d| d as u64)
                    .collect(),
            })
            .collect();
        let sizes: Vec<u64> = tensors.iter().map(|t| t.byte_len().unwrap_or(0)).collect();
        let plan = match max_shard_size {
            Some(max) => weights::plan_shards(&sizes, max),
            None => std::iter::once(0..tensors.len()).collect(),
        };
        let values = params::values(model);
        let world = self.state.world_size;
        // Every process gathers parameter i when the main process writes it; `next` is the
        // first not gathered yet, so a writer that stopped can be caught up with.
        let next = Cell::new(0usize);
        let failed: RefCell<Option<CommError>> = RefCell::new(None);
        let produce = |i: usize| -> Result<Vec<u8>, WeightsError> {
            next.set(i + 1);
            let mut value = values
                .get(i)
                .cloned()
                .map(params::to_host_f32)
                .unwrap_or_default();
            if let Some(shape) = &whole[i] {
                let mut all = vec![0.0f32; value.len() * world];
                if let Err(e) = self.comm.timed(|group| group.all_gather(&value, &mut all)) {
                    failed.borrow_mut().get_or_insert(e);
                    return Err(WeightsError::Malformed {
                        path: dir.to_path_buf(),
                        what: "gathering a sharded parameter failed".into(),
                    });
                }
                all.truncate(shape.iter().product());
                value = all;
            }
            Ok(value.iter().flat_map(|v| v.to_le_bytes()).collect())
        };
        let metadata = BTreeMap::from([(SAVED_BY_KEY.to_string(), SAVED_BY.to_string())]);
        let written = if self.is_main_process() {
            write_files(dir, &tensors, &sizes, &plan, &metadata, &produce)
        } else {
            Ok(paths(dir, plan.len()))
        };
        for i in next.get()..tensors.len() {
            let _ = produce(i);
        }
        if let Some(e) = failed.into_inner() {
            return Err(e.into());
        }
        let mine = written.as_ref().map(drop).map_err(ToString::to_string);
        if let Err(failures) = self.comm.agree(mine)? {
            return Err(match written {
                Err(e) => self.weights_error(e),
                Ok(_) => AccelerateError::Tensor {
                    rank: self.state.rank,
                    op: "saving a model with sharded units",
                    detail: failures.to_string(),
                },
            });
        }
        written.map_err(|e| self.weights_error(e))
    }
}

/// The files a save of `count` shards writes into `dir`.
fn paths(dir: &Path, count: usize) -> Vec<PathBuf> {
    if count <= 1 {
        return vec![dir.join(MODEL_FILE)];
    }
    let mut files: Vec<PathBuf> = (0..count)
        .map(|i| dir.join(weights::shard_file_name(i, count)))
        .collect();
    files.push(dir.join(INDEX_FILE));
    files
}

/// The main process's part: one file, or the shards of `plan` and their index.
fn write_files(
    dir: &Path,
    tensors: &[StreamedTensor],
    sizes: &[u64],
    plan: &[std::ops::Range<usize>],
    metadata: &BTreeMap<String, String>,
    produce: &dyn Fn(usize) -> Result<Vec<u8>, WeightsError>,
) -> Result<Vec<PathBuf>, WeightsError> {
    if plan.len() <= 1 {
        let save = WholeSave::begin(dir)?;
        let path = dir.join(MODEL_FILE);
        accelerate_core::checkpoint::replace_file(&path, |temporary| {
            weights::write_streamed(temporary, tensors, metadata, produce).map(drop)
        })?;
        save.finish()?;
        return Ok(vec![path]);
    }
    let save = ShardedSave::begin(dir)?;
    let mut weight_map = Vec::with_capacity(tensors.len());
    for (i, range) in plan.iter().enumerate() {
        let file = weights::shard_file_name(i, plan.len());
        let in_shard = tensors.get(range.clone()).unwrap_or_default();
        weights::write_streamed(&save.shard_path(&file), in_shard, metadata, |j| {
            produce(range.start + j)
        })?;
        weight_map.extend(in_shard.iter().map(|t| (t.name.clone(), file.clone())));
    }
    let total = sizes.iter().fold(0u64, |sum, s| sum.saturating_add(*s));
    save.commit(&ShardIndex::new(total, weight_map))
}
