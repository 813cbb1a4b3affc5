//! The model's weights alone, as plain Burn and the Hugging Face hub lay them out:
//! `save_model` writes one `model.safetensors`, `save_model_sharded` the hub's shards and
//! index, and `load_model` reads either. The file protocol (staging, what a save may replace)
//! is accelerate-core's [`weights`](accelerate_core::weights); here are the tensors.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use accelerate_core::weights::{
    self, INDEX_FILE, SAVED_BY, SAVED_BY_KEY, ShardIndex, ShardedSave, WeightsError, WholeSave,
};
use burn::module::Module;
use burn::store::{ModuleSnapshot, SafetensorsStore};

use super::{Accelerator, MODEL_FILE};
use crate::backend::AcceleratorBackend;
use crate::checkpoint::first_line;
use crate::error::AccelerateError;

impl<B: AcceleratorBackend> Accelerator<B> {
    /// Writes `model`'s parameters to `dir/model.safetensors` on the main process (other
    /// processes write nothing) and returns the file's path. A model with sharded units
    /// (ZeRO-3) is written whole all the same, one parameter gathered at a time (every
    /// process must call it then). The file is written to a
    /// temporary name, synced and renamed, so a crash never leaves a truncated one; a plain Burn
    /// program loads it with `burn::store::SafetensorsStore` and `load_from`. A sharded model
    /// that an earlier `save_model_sharded` wrote in `dir` is removed once the file is in
    /// place; a sharded model that accelerate-rs did not write stops the save (an error,
    /// nothing written). Float parameters are written in the
    /// [`export_dtype`](crate::AcceleratorBuilder::export_dtype), if one is set.
    pub fn save_model<M: Module>(
        &self,
        model: &M,
        dir: impl AsRef<Path>,
    ) -> Result<PathBuf, AccelerateError> {
        let dir = dir.as_ref();
        let path = dir.join(MODEL_FILE);
        if self.has_sharded_units(model) {
            self.save_sharded_units(model, dir, None)?;
            return Ok(path);
        }
        if !self.is_main_process() {
            return Ok(path);
        }
        let save = WholeSave::begin(dir).map_err(|e| self.weights_error(e))?;
        accelerate_core::checkpoint::replace_file(&path, |temporary| {
            let store = SafetensorsStore::from_file(temporary)
                .overwrite(true)
                .metadata(SAVED_BY_KEY, SAVED_BY);
            model.save_into(&mut self.exporting(store))
        })
        .map_err(|e| AccelerateError::Io {
            rank: self.state.rank,
            action: "saving the model",
            path: path.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
        save.finish().map_err(|e| self.weights_error(e))?;
        Ok(path)
    }

    /// Writes `model`'s parameters into `dir` as the Hugging Face hub lays out a large model,
    /// on the main process: shards of at most `max_shard_size` bytes
    /// (`model-00001-of-00003.safetensors`, ...; a tensor larger than that has a shard of its
    /// own) and `model.safetensors.index.json` mapping each tensor to its shard. A model that
    /// fits one shard is written as `save_model` writes it. Returns the files written.
    ///
    /// Each shard is streamed to disk a tensor at a time (one tensor's bytes in memory beyond
    /// the model), into a staging directory; only when all are written are they moved into
    /// place with their index, and the model an earlier save of ours left in `dir` (a whole
    /// file, or shards no longer named) removed. [`load_model`](Self::load_model) reads the
    /// result; `accelerate-rs merge-weights` makes one file of it. A model with sharded units
    /// (ZeRO-3) is written as `save_model` writes it, a parameter at a time.
    pub fn save_model_sharded<M: Module>(
        &self,
        model: &M,
        dir: impl AsRef<Path>,
        max_shard_size: u64,
    ) -> Result<Vec<PathBuf>, AccelerateError> {
        let dir = dir.as_ref();
        if self.has_sharded_units(model) {
            return self.save_sharded_units(model, dir, Some(max_shard_size));
        }
        let tensors = model.collect(None, None, false);
        // Each tensor's bytes in the file: float ones in the export dtype, if one is set.
        let export = self.checkpoints.export_dtype;
        let sizes: Vec<u64> = tensors
            .iter()
            .map(|t| match export.filter(|_| t.dtype.is_float()) {
                Some(dtype) => (t.shape.iter().product::<usize>() * dtype.size()) as u64,
                None => t.byte_len() as u64,
            })
            .collect();
        let names: Vec<String> = tensors.into_iter().map(|t| t.name).collect();
        let plan = weights::plan_shards(&sizes, max_shard_size);
        if plan.len() <= 1 {
            return Ok(vec![self.save_model(model, dir)?]);
        }
        if !self.is_main_process() {
            return Ok(super::sharded_weights::paths(dir, plan.len()));
        }
        let save = ShardedSave::begin(dir).map_err(|e| self.weights_error(e))?;
        let mut weight_map = Vec::with_capacity(names.len());
        for (i, range) in plan.iter().enumerate() {
            let file = weights::shard_file_name(i, plan.len());
            let path = save.shard_path(&file);
            let in_shard = names.get(range.clone()).unwrap_or_default();
            let store = SafetensorsStore::from_file(&path)
                .with_full_paths(in_shard.iter().cloned())
                .metadata(SAVED_BY_KEY, SAVED_BY);
            let mut store = self.exporting(store);
            model
                .save_into(&mut store)
                .map_err(|e| AccelerateError::Io {
                    rank: self.state.rank,
                    action: "saving a shard of the model",
                    path: dir.join(&file),
                    source: std::io::Error::other(e.to_string()),
                })?;
            weight_map.extend(in_shard.iter().map(|name| (name.clone(), file.clone())));
        }
        let total = sizes.iter().fold(0u64, |sum, s| sum.saturating_add(*s));
        save.commit(&ShardIndex::new(total, weight_map))
            .map_err(|e| self.weights_error(e))
    }

    /// `model` with the weights at `path`: a safetensors file, or a directory holding a
    /// `model.safetensors` (preferred, as the hub's loaders do) or a sharded model
    /// (`model.safetensors.index.json` and its shards, each read in turn). Every tensor of
    /// `model` (float, Int and Bool parameters) must be found, and every tensor found must have
    /// a place in `model`. Into a model with sharded units (ZeRO-3) each process reads only its
    /// shard of each float parameter (fine-tuning a model from the hub that no process could
    /// hold whole); Int and Bool parameters, never sharded, are read whole.
    pub fn load_model<M: Module>(
        &self,
        model: M,
        path: impl AsRef<Path>,
    ) -> Result<M, AccelerateError> {
        let path = path.as_ref();
        if self.has_sharded_units(&model) {
            return self.load_sharded_units(model, path);
        }
        let whole = if path.is_dir() {
            // A sharded save killed while it published here is finished first.
            weights::finish_interrupted(path);
            path.join(MODEL_FILE)
        } else {
            path.to_path_buf()
        };
        if !whole.exists() && !path.join(INDEX_FILE).exists() {
            return Err(self.weights_error(WeightsError::Io {
                action: "finding the model's weights in",
                path: path.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("neither a safetensors file nor a directory with {MODEL_FILE} or {INDEX_FILE}"),
                ),
            }));
        }
        if whole.exists() {
            return crate::checkpoint::load_weights(model, &whole).map_err(|e| {
                AccelerateError::WeightsMismatch {
                    rank: self.state.rank,
                    path: whole.clone(),
                    detail: e.to_string(),
                }
            });
        }
        let index = ShardIndex::read(path).map_err(|e| self.weights_error(e))?;
        let expected: BTreeSet<String> = model
            .collect(None, None, false)
            .into_iter()
            .map(|t| t.name)
            .collect();
        let mismatch = |detail: String| AccelerateError::WeightsMismatch {
            rank: self.state.rank,
            path: path.to_path_buf(),
            detail,
        };
        let dtypes = crate::file_dtypes::ModelDtypes::of(&model);
        let mut model = model;
        let mut loaded = BTreeSet::new();
        for file in index.files() {
            let shard = path.join(file);
            if !shard.is_file() {
                return Err(self.weights_error(WeightsError::Io {
                    action: "reading the shard",
                    path: shard,
                    source: std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "the index lists it, and it is missing (the save was copied in part?)",
                    ),
                }));
            }
            let mut store = SafetensorsStore::from_file(&shard)
                .allow_partial(true)
                .with_from_adapter(dtypes.clone());
            let applied = model
                .load_from(&mut store)
                .map_err(|e| mismatch(format!("{file}: {}", first_line(&e.to_string()))))?;
            if let Some(extra) = applied.unused.first() {
                return Err(mismatch(format!(
                    "{file} holds {extra}, which the model has no place for"
                )));
            }
            if !applied.errors.is_empty() {
                return Err(mismatch(format!("{file}: {:?}", applied.errors)));
            }
            loaded.extend(applied.applied);
        }
        let missing: Vec<&String> = expected.difference(&loaded).collect();
        if !missing.is_empty() {
            return Err(mismatch(format!(
                "no shard holds {} of the model's tensors (the first: {})",
                missing.len(),
                missing[0]
            )));
        }
        Ok(model)
    }

    /// `store` writing float tensors in the export dtype, if one is set.
    fn exporting(&self, store: SafetensorsStore) -> SafetensorsStore {
        match self.checkpoints.export_dtype {
            Some(dtype) => store.with_to_adapter(crate::file_dtypes::ExportDtype(dtype)),
            None => store,
        }
    }

    pub(super) fn weights_error(&self, source: WeightsError) -> AccelerateError {
        AccelerateError::Weights {
            rank: self.state.rank,
            source,
        }
    }
}
