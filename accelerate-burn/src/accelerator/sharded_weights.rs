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
use burn::store::burn_pack::Tensor as PackTensor;
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::{BoolStore, DType};

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
        // Every tensor of the model in Burn's order: the float parameters (gathered where
        // sharded, written in the export dtype) and the rest (Int and Bool parameters, never
        // sharded) written as the model holds them, so the file is what plain Burn's save
        // writes.
        let export = self.checkpoints.export_dtype.unwrap_or(DType::F32);
        let export_name = safetensors_dtype(export).unwrap_or("F32");
        let float_index: BTreeMap<&str, usize> = layout
            .entries
            .iter()
            .enumerate()
            .map(|(k, entry)| (entry.path.as_str(), k))
            .collect();
        let mut sources = Vec::new();
        let mut tensors = Vec::new();
        for snapshot in model.collect(None, None, false) {
            let (source, tensor) = match float_index.get(snapshot.name.as_str()) {
                Some(&k) => {
                    let entry = &layout.entries[k];
                    let shape = whole[k].as_ref().unwrap_or(&entry.shape);
                    let tensor = StreamedTensor {
                        name: entry.path.clone(),
                        dtype: export_name.into(),
                        shape: shape.iter().map(|&d| d as u64).collect(),
                    };
                    (Saved::Float(k), tensor)
                }
                None => {
                    let dtype = safetensors_dtype(snapshot.dtype).ok_or_else(|| {
                        self.weights_error(WeightsError::Malformed {
                            path: dir.to_path_buf(),
                            what: format!(
                                "{} is {:?}, which a safetensors file cannot hold",
                                snapshot.name, snapshot.dtype
                            ),
                        })
                    })?;
                    let tensor = StreamedTensor {
                        name: snapshot.name.clone(),
                        dtype: dtype.into(),
                        shape: snapshot.shape.iter().map(|&d| d as u64).collect(),
                    };
                    (Saved::Other(snapshot), tensor)
                }
            };
            sources.push(source);
            tensors.push(tensor);
        }
        let sizes: Vec<u64> = tensors.iter().map(|t| t.byte_len().unwrap_or(0)).collect();
        let plan = match max_shard_size {
            Some(max) => weights::plan_shards(&sizes, max),
            None => std::iter::once(0..tensors.len()).collect(),
        };
        let values = params::values(model);
        // A shard is cut across the shard group (the job, without hybrid sharding): each
        // group gathers its own, the main process's writes.
        let shard_comm = self.shards.comm();
        let world = shard_comm.world_size();
        let main = self.is_main_process();
        // Every process gathers parameter i when the main process writes it; `next` is the
        // first not gathered yet, so a writer that stopped can be caught up with.
        let next = Cell::new(0usize);
        let failed: RefCell<Option<CommError>> = RefCell::new(None);
        let produce = |i: usize| -> Result<Vec<u8>, WeightsError> {
            next.set(i + 1);
            let k = match sources.get(i) {
                Some(Saved::Float(k)) => *k,
                Some(Saved::Other(snapshot)) if main => {
                    return snapshot.to_bytes().map(|b| b.to_vec()).map_err(|e| {
                        WeightsError::Malformed {
                            path: dir.to_path_buf(),
                            what: format!("reading {} failed: {e}", snapshot.name),
                        }
                    });
                }
                _ => return Ok(Vec::new()),
            };
            let mut value = values
                .get(k)
                .cloned()
                .map(params::to_host_f32)
                .unwrap_or_default();
            if let Some(shape) = &whole[k] {
                let mut all = vec![0.0f32; value.len() * world];
                if let Err(e) = shard_comm.timed(|group| group.all_gather(&value, &mut all)) {
                    failed.borrow_mut().get_or_insert(e);
                    return Err(WeightsError::Malformed {
                        path: dir.to_path_buf(),
                        what: "gathering a sharded parameter failed".into(),
                    });
                }
                all.truncate(shape.iter().product());
                value = all;
            }
            Ok(crate::file_dtypes::f32_bytes_as(&value, export))
        };
        let metadata = BTreeMap::from([(SAVED_BY_KEY.to_string(), SAVED_BY.to_string())]);
        let written = if main {
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

impl<B: AcceleratorBackend> Accelerator<B> {
    /// `model` (with sharded units) with the weights at `path` (see `load_model`): each
    /// parameter read from its file by byte range, only this process's shard of a sharded one.
    pub(crate) fn load_sharded_units<M: Module>(
        &self,
        model: M,
        path: &Path,
    ) -> Result<M, AccelerateError> {
        let files = weight_files(path).map_err(|e| self.weights_error(e))?;
        let mismatch = |detail: String| AccelerateError::WeightsMismatch {
            rank: self.state.rank,
            path: path.to_path_buf(),
            detail,
        };
        let layout = ParamLayout::of(&model);
        let (rank, world) = self.shards.shard_job();
        let mut used = std::collections::BTreeSet::new();
        let mut values = Vec::with_capacity(layout.entries.len());
        for entry in &layout.entries {
            let Some((file, header)) = files
                .iter()
                .find(|(_, header)| header.tensors.contains_key(&entry.path))
            else {
                return Err(mismatch(format!("no file holds {}", entry.path)));
            };
            let tensor = &header.tensors[&entry.path];
            let shape = self
                .shards
                .whole_shape(entry.id)
                .unwrap_or_else(|| entry.shape.clone());
            if tensor
                .shape
                .iter()
                .map(|&d| d as usize)
                .ne(shape.iter().copied())
            {
                return Err(mismatch(format!(
                    "{} is {:?} there and {shape:?} in the model",
                    entry.path, tensor.shape
                )));
            }
            let numel: usize = shape.iter().product();
            // A sharded parameter's elements of this rank; a whole one's all.
            let range = match self.shards.whole_shape(entry.id) {
                Some(_) => {
                    let len = numel.div_ceil(world).max(1);
                    (rank * len).min(numel)..((rank + 1) * len).min(numel)
                }
                None => 0..numel,
            };
            let mut part = read_f32(file, header.data_start, tensor, range)
                .map_err(|e| mismatch(format!("{}: {e}", entry.path)))?;
            part.resize(entry.numel, 0.0);
            values.push(Some(params::upload(part, &self.device)));
            used.insert(entry.path.clone());
        }
        let mut model = params::replace(
            model,
            params::Replacement {
                values,
                ids: Vec::new(),
            },
        );
        // The other tensors (Int and Bool parameters, never sharded) are read whole by Burn,
        // each file's in turn.
        let others: Vec<String> = model
            .collect(None, None, false)
            .into_iter()
            .map(|snapshot| snapshot.name)
            .filter(|name| !used.contains(name))
            .collect();
        for (file, header) in &files {
            let here: Vec<&String> = others
                .iter()
                .filter(|name| header.tensors.contains_key(*name))
                .collect();
            if here.is_empty() {
                continue;
            }
            let mut store = SafetensorsStore::from_file(file)
                .allow_partial(true)
                .with_full_paths(here.iter().map(|name| name.to_string()));
            let applied = model
                .load_from(&mut store)
                .map_err(|e| mismatch(format!("{}: {e}", file.display())))?;
            if !applied.errors.is_empty() {
                return Err(mismatch(format!(
                    "{}: {:?}",
                    file.display(),
                    applied.errors
                )));
            }
            used.extend(here.into_iter().cloned());
        }
        if let Some(missing) = others.iter().find(|name| !used.contains(*name)) {
            return Err(mismatch(format!("no file holds {missing}")));
        }
        if let Some(extra) = files
            .iter()
            .flat_map(|(_, header)| header.tensors.keys())
            .find(|name| !used.contains(*name))
        {
            return Err(mismatch(format!("{extra} has no place in the model")));
        }
        Ok(model)
    }
}

/// Every safetensors file of the weights at `path` (a file, a directory with
/// `model.safetensors`, or a sharded model's directory) with its header.
fn weight_files(path: &Path) -> Result<Vec<(PathBuf, weights::Header)>, WeightsError> {
    if path.is_dir() {
        // A sharded save killed while it published here is finished first.
        weights::finish_interrupted(path);
    }
    let files: Vec<PathBuf> = if !path.is_dir() {
        vec![path.to_path_buf()]
    } else if path.join(MODEL_FILE).is_file() {
        vec![path.join(MODEL_FILE)]
    } else {
        let index = ShardIndex::read(path)?;
        index.files().into_iter().map(|f| path.join(f)).collect()
    };
    files
        .into_iter()
        .map(|file| {
            let header = weights::read_header(&file)?;
            Ok((file, header))
        })
        .collect()
}

/// Elements `range` of the tensor `tensor` of `file` (its data from `data_start`), as f32
/// (F32, F16 and BF16 files; the header reader checked the tensor's bytes lie in the file).
fn read_f32(
    file: &Path,
    data_start: u64,
    tensor: &weights::TensorEntry,
    range: std::ops::Range<usize>,
) -> Result<Vec<f32>, WeightsError> {
    use std::io::{Read, Seek, SeekFrom};
    let size = match tensor.dtype.as_str() {
        "F32" => 4,
        "F16" | "BF16" => 2,
        other => {
            return Err(WeightsError::Malformed {
                path: file.to_path_buf(),
                what: format!("{other} values cannot be a float parameter here"),
            });
        }
    };
    let start = data_start + tensor.data_offsets[0] + (range.start * size) as u64;
    let mut bytes = vec![0u8; range.len() * size];
    std::fs::File::open(file)
        .and_then(|mut handle| {
            handle.seek(SeekFrom::Start(start))?;
            handle.read_exact(&mut bytes)
        })
        .map_err(|source| WeightsError::Io {
            action: "reading",
            path: file.to_path_buf(),
            source,
        })?;
    Ok(match tensor.dtype.as_str() {
        "F32" => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        "F16" => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    })
}

/// The files a save of `count` shards writes into `dir`.
pub(super) fn paths(dir: &Path, count: usize) -> Vec<PathBuf> {
    if count <= 1 {
        return vec![dir.join(MODEL_FILE)];
    }
    let mut files: Vec<PathBuf> = (0..count)
        .map(|i| dir.join(weights::shard_file_name(i, count)))
        .collect();
    files.push(dir.join(INDEX_FILE));
    files
}

/// Where a saved tensor's bytes come from.
enum Saved {
    /// Float parameter `k` of the layout, gathered where it is sharded.
    Float(usize),
    /// Any other tensor (an Int or Bool parameter), as the model holds it.
    Other(PackTensor),
}

/// The safetensors name of `dtype`, as Burn's own safetensors writer names it; `None` for one
/// a safetensors file cannot hold.
fn safetensors_dtype(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F64 => "F64",
        DType::F32 | DType::Flex32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::I64 => "I64",
        DType::I32 => "I32",
        DType::I16 => "I16",
        DType::I8 => "I8",
        DType::U64 => "U64",
        DType::U32 | DType::Bool(BoolStore::U32) => "U32",
        DType::U8 | DType::Bool(BoolStore::U8) => "U8",
        DType::Bool(BoolStore::Native) => "BOOL",
        DType::U16 | DType::QFloat(_) => return None,
    })
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
