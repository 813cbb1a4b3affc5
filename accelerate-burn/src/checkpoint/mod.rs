//! Checkpoints of a whole training run: what `save_state` / `load_state` take and return, and
//! the directory protocol they follow (in `save` and `load`); each component writes and
//! reads its own part.
//!
//! A checkpoint directory holds the model (`model.safetensors`), the optimizer's state as its
//! reducer writes it (Burn's record `optimizer.bpk`, or one `fused_optimizer_<r>.bin` per
//! shard), the scheduler record (`scheduler.bpk`), `training_state.json` (parameter ids,
//! optimizer kind, user objects) from the main process, one `rank_<r>.json` per process (loop
//! counters, fp16 scaler, where the training loader stands), and `manifest.json`, written last.
//! Each other model saved with its optimizer has a directory of its own with its weights and
//! optimizer files (`<name>/model.safetensors`, ...); its loop counters are in the rank files.
//! Every rank writes into `<dir>.partial`; the directory is renamed into place only after all
//! of them finished, so a crash mid-save never leaves something that loads (see
//! [`accelerate_core::checkpoint`]).
//!
//! Exact resume: the training loader continues the saved epoch with the batches the saved run
//! would have had next, counters and the loss scale continue, the optimizer's state is keyed
//! to the same parameter ids, and with a seed the device's random stream is reseeded at every
//! window boundary from `(seed, rank, windows)`, so dropout after a resume draws what it would
//! have drawn without one.

mod background;
pub(crate) mod load;
pub(crate) mod save;
mod staging;

use std::collections::BTreeMap;
use std::path::PathBuf;

use accelerate_core::ProcessState;
use burn::module::Module;
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::Device;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::AccelerateError;
use crate::group::Comm;
use crate::loader_link::LoaderLinks;
use crate::model_slot::ModelSlots;
use crate::optim::{PreparedOptimizer, PreparedScheduler};
use crate::sharded::ShardGroup;

pub use crate::reducer::bucketed::OPTIMIZER_FILE;
pub(crate) use crate::stage_error::StageError;
pub(crate) use background::BackgroundSave;
pub use staging::CheckpointSnapshot;

/// The model's weights in a checkpoint (and what `save_model` writes).
pub const MODEL_FILE: &str = "model.safetensors";
/// The learning-rate scheduler's record in a checkpoint.
pub const SCHEDULER_FILE: &str = "scheduler.bpk";
/// Parameter ids, optimizer kind and user objects, from the main process.
pub const TRAINING_STATE_FILE: &str = "training_state.json";

fn rank_file(rank: usize) -> String {
    format!("rank_{rank}.json")
}

/// The file of the extra module saved under `name` ([`Checkpoint::module`]).
pub fn module_file(name: &str) -> String {
    format!("module_{name}.safetensors")
}

/// Beginnings of the names the checkpoint's own files and directories have (ZeRO-3's shards
/// and Burn optimizer records, the fused optimizer's shards, each rank's state): a pair or
/// module named so could share a path with them, so such names are refused.
const RESERVED_PREFIXES: [&str; 3] = ["zero3_", "fused_optimizer_", "rank_"];

/// True for names that make a plain file name (ASCII letters, digits, `-` and `_`) and do
/// not begin as the checkpoint's own files do ([`RESERVED_PREFIXES`]).
fn valid_module_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        && !RESERVED_PREFIXES
            .iter()
            .any(|prefix| name.starts_with(prefix))
}

/// What to save besides what the accelerator tracks itself: the model, its prepared
/// optimizer, optionally the prepared scheduler, other modules (an EMA copy, a frozen
/// teacher) and named user objects (any `serde` value).
///
/// ```text
/// acc.save_state(dir, &Checkpoint::new(&model, &optim).scheduler(&sched).module("ema", &ema).object("best", &best))?;
/// ```
pub struct Checkpoint<'a, M> {
    model: &'a M,
    optimizer: &'a PreparedOptimizer,
    scheduler: Option<&'a PreparedScheduler>,
    /// Serialised when the save writes them (so a value is taken as it is at that point).
    objects: Vec<(String, ObjectWriter<'a>)>,
    /// Other modules, each written to its own safetensors file by the main process (or, with
    /// sharded units, to one file of shards per rank).
    modules: Vec<ModulePart<'a>>,
    /// Other models trained with their own prepared optimizers, each in its own directory.
    pairs: Vec<PairPart<'a>>,
}

/// A module saved beside the model ([`Checkpoint::module`]).
pub(crate) struct ModulePart<'a> {
    pub name: String,
    /// Writes it whole (the main process).
    pub write: ModuleWriter<'a>,
    /// Its parameters, and their values when the save runs (for sharded units).
    pub layout: crate::params::ParamLayout,
    pub values: Box<dyn Fn() -> Vec<burn::tensor::Tensor<1>> + 'a>,
}

/// A model and its prepared optimizer saved under a name ([`Checkpoint::pair`]).
pub(crate) struct PairPart<'a> {
    pub name: String,
    pub write_model: ModuleWriter<'a>,
    pub param_ids: Vec<u64>,
    /// The model's parameters and their values when the save runs (for sharded units).
    pub layout: crate::params::ParamLayout,
    pub values: Box<dyn Fn() -> Vec<burn::tensor::Tensor<1>> + 'a>,
    pub optimizer: &'a PreparedOptimizer,
    pub scheduler: Option<&'a PreparedScheduler>,
}

type ObjectWriter<'a> = Box<dyn Fn() -> Result<serde_json::Value, serde_json::Error> + 'a>;
/// Saves a module's weights into a safetensors store (a file, or memory).
pub(crate) type ModuleWriter<'a> =
    Box<dyn Fn(&mut SafetensorsStore) -> Result<(), burn::store::SafetensorsStoreError> + 'a>;

/// Saves `module`'s weights into a store when the save runs.
fn module_writer<N: Module>(module: &N) -> ModuleWriter<'_> {
    Box::new(move |store| module.save_into(store))
}

impl<'a, M: Module> Checkpoint<'a, M> {
    /// A checkpoint of `model` and `optimizer`.
    pub fn new(model: &'a M, optimizer: &'a PreparedOptimizer) -> Self {
        Self {
            model,
            optimizer,
            scheduler: None,
            objects: Vec::new(),
            modules: Vec::new(),
            pairs: Vec::new(),
        }
    }

    /// Updates of the checkpoint's optimizer (what names an automatic checkpoint).
    pub(crate) fn optimizer_updates(&self) -> u64 {
        self.optimizer.updates()
    }

    /// Also saves the learning-rate scheduler.
    pub fn scheduler(mut self, scheduler: &'a PreparedScheduler) -> Self {
        self.scheduler = Some(scheduler);
        self
    }

    /// Also saves the weights of another module under `name` (letters, digits, `-`, `_`; not
    /// beginning with `zero3_`, `fused_optimizer_` or `rank_`, which the checkpoint's own files use):
    /// an EMA copy, a frozen teacher, a second network. Read it back with
    /// [`CheckpointInfo::module`]. The main process's module is saved.
    pub fn module<N: Module>(mut self, name: &str, module: &'a N) -> Self {
        self.modules.push(ModulePart {
            name: name.to_string(),
            write: module_writer(module),
            layout: crate::params::ParamLayout::of(module),
            values: Box::new(move || crate::params::values(module)),
        });
        self
    }

    /// Also saves another model trained with its own prepared optimizer (a GAN's second
    /// network, a student beside its teacher) under `name` (letters, digits, `-`, `_`; not
    /// beginning with `zero3_`, `fused_optimizer_` or `rank_`): its
    /// weights, its optimizer's state and its loop counters, in the directory `name` of the
    /// checkpoint. Restore it with [`Accelerator::load_pair`](crate::Accelerator::load_pair).
    pub fn pair<N: Module>(
        mut self,
        name: &str,
        model: &'a N,
        optimizer: &'a PreparedOptimizer,
    ) -> Self {
        let layout = crate::params::ParamLayout::of(model);
        self.pairs.push(PairPart {
            name: name.to_string(),
            write_model: module_writer(model),
            param_ids: layout.ids(),
            layout,
            values: Box::new(move || crate::params::values(model)),
            optimizer,
            scheduler: None,
        });
        self
    }

    /// [`pair`](Self::pair) with the learning-rate scheduler that follows `optimizer`
    /// (`acc.prepare_scheduler_for(&optimizer, ...)`), saved in the pair's directory.
    pub fn pair_with_scheduler<N: Module>(
        self,
        name: &str,
        model: &'a N,
        optimizer: &'a PreparedOptimizer,
        scheduler: &'a PreparedScheduler,
    ) -> Self {
        let mut checkpoint = self.pair(name, model, optimizer);
        if let Some(pair) = checkpoint.pairs.last_mut() {
            pair.scheduler = Some(scheduler);
        }
        checkpoint
    }

    /// Also saves `value` under `name` (read it back with [`CheckpointInfo::object`]). The main
    /// process's value is saved.
    pub fn object<T: Serialize>(mut self, name: &str, value: &'a T) -> Self {
        let writer: ObjectWriter<'a> = Box::new(move || serde_json::to_value(value));
        self.objects.push((name.to_string(), writer));
        self
    }
}

/// What [`Accelerator::load_state`](crate::Accelerator::load_state) restored: the model, and
/// what else the checkpoint held.
#[derive(Debug)]
pub struct Restored<M> {
    /// The model with the checkpoint's parameters.
    pub model: M,
    /// Where the checkpoint came from, its update count and user objects.
    pub info: CheckpointInfo,
}

/// A loaded checkpoint's place in the run and its user objects.
#[derive(Debug, Clone)]
pub struct CheckpointInfo {
    /// The checkpoint loaded (`None` when there was none to load: a fresh start).
    pub path: Option<PathBuf>,
    /// Optimizer updates applied before the checkpoint.
    pub updates: u64,
    rank: usize,
    objects: BTreeMap<String, serde_json::Value>,
    /// The job's sharded units (ZeRO-3) and how they are cut, for modules saved in shards.
    pub(crate) sharding: Option<std::sync::Arc<ShardGroup>>,
}

impl CheckpointInfo {
    /// The record of a fresh start (no checkpoint loaded).
    pub(crate) fn fresh(rank: usize) -> Self {
        Self {
            path: None,
            updates: 0,
            rank,
            objects: BTreeMap::new(),
            sharding: None,
        }
    }

    /// `module` with the weights saved under `name` by [`Checkpoint::module`]; on a fresh start
    /// (no checkpoint was loaded), `module` as it is. Every process reads the file.
    pub fn module<N: Module>(&self, name: &str, module: N) -> Result<N, AccelerateError> {
        let Some(dir) = &self.path else {
            return Ok(module);
        };
        let file = module_file(name);
        let mismatch = |detail: String| AccelerateError::ResumeMismatch {
            rank: self.rank,
            path: dir.clone(),
            detail,
            hint: "load the modules the checkpoint was saved with, under the names it used",
        };
        if valid_module_name(name)
            && let Some(shards) = &self.sharding
        {
            let files = accelerate_core::checkpoint::read_manifest(dir)
                .map_err(|e| mismatch(e.to_string()))?
                .files;
            let prefix = crate::reducer::sharded_files::module_prefix(name);
            if crate::reducer::sharded_files::has_shards(&files, &prefix) {
                let layout = crate::params::ParamLayout::of(&module);
                let device = module.devices().into_iter().next().unwrap_or_default();
                let saved = SavedShards {
                    dir,
                    prefix: &prefix,
                    files: &files,
                    job: shards.shard_job(),
                };
                return saved
                    .load_into(module, &layout, &shards.numels(&layout), &device)
                    .map_err(|e| mismatch(e.to_string()));
            }
        }
        if !valid_module_name(name) || !dir.join(&file).is_file() {
            return Err(mismatch(format!("it holds no module named {name:?}")));
        }
        load_weights(module, &dir.join(&file)).map_err(|e| mismatch(e.to_string()))
    }

    /// The user object saved under `name`, or `None` if the checkpoint has none by that name.
    pub fn object<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, AccelerateError> {
        let Some(value) = self.objects.get(name) else {
            return Ok(None);
        };
        serde_json::from_value(value.clone())
            .map(Some)
            .map_err(|e| AccelerateError::ResumeMismatch {
                rank: self.rank,
                path: self.path.clone().unwrap_or_default(),
                detail: format!("object {name:?} does not decode as the type asked for: {e}"),
                hint: "read it as the type it was saved as",
            })
    }
}

/// What a module with sharded units is loaded from: the shard files of `prefix` in `dir`
/// (among the checkpoint's `files`), saved by any number of processes, and the job (rank,
/// world size) that loads them.
pub(crate) struct SavedShards<'a> {
    pub dir: &'a std::path::Path,
    pub prefix: &'a str,
    pub files: &'a [accelerate_core::checkpoint::ManifestFile],
    pub job: (usize, usize),
}

impl SavedShards<'_> {
    /// `module` (of `layout`) with this rank's values: its shard of each parameter `numels`
    /// marks as sharded, the whole value of the others, on `device`.
    pub(crate) fn load_into<N: Module>(
        &self,
        module: N,
        layout: &crate::params::ParamLayout,
        numels: &[Option<usize>],
        device: &Device,
    ) -> Result<N, StageError> {
        let values = crate::reducer::sharded_files::read_model(
            self.dir,
            self.prefix,
            self.files,
            layout,
            numels,
            self.job,
        )?;
        let values = values
            .into_iter()
            .map(|v| Some(crate::params::upload(v, device)))
            .collect();
        Ok(crate::params::replace(
            module,
            crate::params::Replacement {
                values,
                ids: Vec::new(),
            },
        ))
    }
}

/// The first line of Burn's store errors (a multi-line table), which says what went wrong.
pub(crate) fn first_line(message: &str) -> &str {
    message
        .lines()
        .next()
        .unwrap_or_default()
        .trim_end_matches([':', ' '])
}

/// `module` with the weights of the safetensors file at `path`; the error says what does not
/// fit.
pub(crate) fn load_weights<M: Module>(
    mut module: M,
    path: &std::path::Path,
) -> Result<M, StageError> {
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    // Each float tensor in the dtype of the module's own parameter (a bf16 export into an
    // f32 model).
    let dtypes = crate::file_dtypes::ModelDtypes::of(&module);
    let mut store = SafetensorsStore::from_file(path).with_from_adapter(dtypes);
    let applied = module
        .load_from(&mut store)
        .map_err(|e| StageError::DoesNotFit {
            file: name.clone(),
            detail: first_line(&e.to_string()).to_string(),
        })?;
    if !applied.errors.is_empty() || !applied.missing.is_empty() {
        let missing: Vec<&str> = applied.missing.iter().map(|(p, _)| p.as_str()).collect();
        return Err(StageError::DoesNotFit {
            file: name,
            detail: format!(
                "missing: [{}], errors: {:?}",
                missing.join(", "),
                applied.errors
            ),
        });
    }
    Ok(module)
}

/// The main process's part of `training_state.json`.
#[derive(Serialize, Deserialize)]
struct TrainingState {
    /// Ids of the model's float parameters, in visit order (the optimizer record is keyed
    /// by them).
    param_ids: Vec<u64>,
    /// The reducer kind that wrote the optimizer state (`burn`, `fused`).
    #[serde(default)]
    optimizer: Option<String>,
    /// True when a scheduler record was saved.
    scheduler: bool,
    /// User objects.
    objects: BTreeMap<String, serde_json::Value>,
    /// The other models saved with their optimizers ([`Checkpoint::pair`]), by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pairs: BTreeMap<String, PairState>,
}

/// What `training_state.json` says of one model saved with its optimizer.
#[derive(Serialize, Deserialize)]
struct PairState {
    /// Ids of its float parameters, in visit order.
    param_ids: Vec<u64>,
    /// The reducer kind that wrote its optimizer state.
    optimizer: String,
    /// True when its scheduler's record was saved.
    #[serde(default)]
    scheduler: bool,
}

/// What the directory protocol needs of the accelerator.
pub(crate) struct Context<'a> {
    pub state: &'a ProcessState,
    pub comm: &'a Comm,
    pub slots: &'a ModelSlots,
    pub links: &'a LoaderLinks,
    pub device: &'a Device,
    pub seed: Option<u64>,
    /// Whether a checkpoint of another world size may be loaded.
    pub resume_any_world_size: bool,
    /// The sharded units' bookkeeping (ZeRO-3): a loaded model's shards take saved ids.
    pub shards: &'a std::sync::Arc<ShardGroup>,
}

impl Context<'_> {
    /// Every rank's outcome of `stage`, on every rank: the first failures (naming their ranks)
    /// become this rank's error too.
    pub(crate) fn agree(
        &self,
        path: &std::path::Path,
        stage: &'static str,
        mine: Result<(), impl std::fmt::Display>,
    ) -> Result<(), AccelerateError> {
        match self.comm.agree(mine)? {
            Ok(()) => Ok(()),
            Err(failed) => Err(AccelerateError::CheckpointFailed {
                rank: self.state.rank,
                path: path.to_path_buf(),
                stage,
                failures: failed.to_string(),
            }),
        }
    }
}
