//! Checkpoints of a whole training run: [`Accelerator::save_state`] and
//! [`Accelerator::load_state`], and their automatically named, rotated form under a project
//! directory.
//!
//! A checkpoint directory holds the model (`model.safetensors`), the optimizer and scheduler
//! records (Burn's burnpack), `training_state.json` (parameter ids, user objects) from the main
//! process, one `rank_<r>.json` per process (update and window counters, fp16 scaler, where the
//! training loader stands, the random stream), and `manifest.json`, written last. Every rank
//! writes into `<dir>.partial`; the directory is renamed into place only after all of them
//! finished, so a crash mid-save never leaves something that loads (see
//! [`accelerate_core::checkpoint`]).
//!
//! Exact resume: the training loader continues the saved epoch with the batches the saved run
//! would have had next, counters and the loss scale continue, the optimizer's state is keyed
//! to the same parameter ids, and with a seed the device's random stream is reseeded at every
//! window boundary from `(seed, rank, windows)`, so dropout after a resume draws what it would
//! have drawn without one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use accelerate_core::checkpoint::{
    self, CheckpointRotation, LoaderState, Manifest, ManifestFile, RankState,
};
use accelerate_core::sampler::SplitMix64;
use accelerate_core::{CheckpointError, SamplerCursor};
use burn::lr_scheduler::LrSchedulerRecord;
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::OptimizerRecord;
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::Tensor;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::accelerator::{Accelerator, MODEL_FILE};
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;
use crate::fused::FusedStateFile;
use crate::loop_state::{ResumePoint, Skip};
use crate::optim::{PreparedOptimizer, PreparedScheduler};

/// The optimizer's record in a checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.bpk";
/// The learning-rate scheduler's record in a checkpoint.
pub const SCHEDULER_FILE: &str = "scheduler.bpk";
/// Parameter ids and user objects, from the main process.
pub const TRAINING_STATE_FILE: &str = "training_state.json";

fn rank_file(rank: usize) -> String {
    format!("rank_{rank}.json")
}

/// Prefix of the fused optimizer state files (`fused_optimizer_<rank>.bin`).
const FUSED_PREFIX: &str = "fused_optimizer_";

fn fused_file(rank: usize) -> String {
    format!("{FUSED_PREFIX}{rank}.bin")
}

/// What to save besides what the accelerator tracks itself: the model, its prepared
/// optimizer, optionally the prepared scheduler, and named user objects (any `serde` value).
///
/// ```text
/// acc.save_state(dir, &Checkpoint::new(&model, &optim).scheduler(&sched).object("best", &best))?;
/// ```
pub struct Checkpoint<'a, M> {
    model: &'a M,
    optimizer: &'a PreparedOptimizer,
    scheduler: Option<&'a PreparedScheduler>,
    /// Serialised when the save writes them (so a value is taken as it is at that point).
    objects: Vec<(String, ObjectWriter<'a>)>,
}

type ObjectWriter<'a> = Box<dyn Fn() -> Result<serde_json::Value, serde_json::Error> + 'a>;

impl<'a, M: Module> Checkpoint<'a, M> {
    /// A checkpoint of `model` and `optimizer`.
    pub fn new(model: &'a M, optimizer: &'a PreparedOptimizer) -> Self {
        Self {
            model,
            optimizer,
            scheduler: None,
            objects: Vec::new(),
        }
    }

    /// Also saves the learning-rate scheduler.
    pub fn scheduler(mut self, scheduler: &'a PreparedScheduler) -> Self {
        self.scheduler = Some(scheduler);
        self
    }

    /// Also saves `value` under `name` (read it back with [`CheckpointInfo::object`]). The main
    /// process's value is saved.
    pub fn object<T: Serialize>(mut self, name: &str, value: &'a T) -> Self {
        let writer: ObjectWriter<'a> = Box::new(move || serde_json::to_value(value));
        self.objects.push((name.to_string(), writer));
        self
    }
}

/// What [`Accelerator::load_state`] restored: the model, and what else the checkpoint held.
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
}

impl CheckpointInfo {
    /// The user object saved under `name`, or `None` if the checkpoint has none by that name.
    pub fn object<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, AccelerateError> {
        let Some(value) = self.objects.get(name) else {
            return Ok(None);
        };
        serde_json::from_value(value.clone())
            .map(Some)
            .map_err(|e| AccelerateError::Checkpoint {
                rank: self.rank,
                path: self.path.clone().unwrap_or_default(),
                reason: format!("object {name:?} does not decode as the type asked for: {e}"),
            })
    }
}

/// The main process's part of `training_state.json`.
#[derive(Serialize, Deserialize)]
struct TrainingState {
    /// Ids of the model's float parameters, in visit order (the optimizer record is keyed
    /// by them).
    param_ids: Vec<u64>,
    /// True when a scheduler record was saved.
    scheduler: bool,
    /// User objects.
    objects: BTreeMap<String, serde_json::Value>,
}

/// The seed of the device's random stream after `windows` completed windows.
pub(crate) fn window_seed(seed: u64, rank: usize, windows: u64) -> u64 {
    let mut mix = SplitMix64::new(seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let base = mix.next_u64();
    SplitMix64::new(base ^ windows.wrapping_mul(0xD1B5_4A32_D192_ED03)).next_u64()
}

fn param_ids<M: Module>(model: &M) -> Vec<u64> {
    crate::sync::parameters(model)
        .into_iter()
        .map(|(id, _)| id)
        .collect()
}

fn set_param_ids<M: Module>(model: M, ids: Vec<u64>) -> M {
    struct SetIds(std::vec::IntoIter<u64>);
    impl ModuleMapper for SetIds {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, value, mapper) = param.consume();
            let id = self.0.next().map_or(id, ParamId::from);
            Param::from_mapped_value(id, value, mapper)
        }
    }
    model.map(&mut SetIds(ids.into_iter()))
}

impl<B: AcceleratorBackend> Accelerator<B> {
    fn checkpoint_error(&self, path: &Path, reason: impl Into<String>) -> AccelerateError {
        AccelerateError::Checkpoint {
            rank: self.state.rank,
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }

    /// Every rank's outcome, on every rank: the first failure (naming its rank) becomes this
    /// rank's error too, so no process carries on alone and waits for peers that gave up.
    fn agree(
        &self,
        path: &Path,
        stage: &str,
        mine: Result<(), String>,
    ) -> Result<(), AccelerateError> {
        let all = if self.state.is_distributed() {
            self.group().all_gather_object(&mine)?
        } else {
            vec![mine]
        };
        let failed: Vec<String> = all
            .into_iter()
            .enumerate()
            .filter_map(|(r, outcome)| outcome.err().map(|e| format!("rank {r}: {e}")))
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(self.checkpoint_error(path, format!("{stage} failed: {}", failed.join("; "))))
        }
    }

    /// Saves the whole training state into `dir` (every process must call it, at the same
    /// point: after an optimizer update). Returns `dir`.
    ///
    /// The model, optimizer, scheduler and user objects come from the main process (data
    /// parallelism keeps them identical); each process adds its own loop state. Nothing
    /// appears at `dir` until every process has written its part; an existing checkpoint at
    /// `dir` is replaced only then. Saving in the middle of an accumulation window is an error
    /// (its partial gradient sum is not saved).
    pub fn save_state<M: Module>(
        &self,
        dir: impl AsRef<Path>,
        checkpoint: &Checkpoint<'_, M>,
    ) -> Result<PathBuf, AccelerateError> {
        let dir = dir.as_ref().to_path_buf();
        let pending = self.shared.lock().accumulation.pending();
        if pending > 0 {
            return Err(self.checkpoint_error(
                &dir,
                format!(
                    "saving in the middle of an accumulation window ({pending} of {} \
                     micro-batches summed, which a checkpoint does not hold). hint: save \
                     after an optimizer update, when acc.sync_gradients() is true",
                    self.config.gradient_accumulation_steps
                ),
            ));
        }
        let partial = checkpoint::partial_dir(&dir);
        let begun = match self.is_main_process() {
            true => checkpoint::begin_save(&dir)
                .map(drop)
                .map_err(|e| e.to_string()),
            false => Ok(()),
        };
        self.agree(&dir, "starting the save", begun)?;

        let written = self.write_own_files(&partial, checkpoint);
        let files = match &written {
            Ok(files) => files.clone(),
            Err(_) => Vec::new(),
        };
        let all_files: Vec<Vec<ManifestFile>> = if self.state.is_distributed() {
            self.group().all_gather_object(&files)?
        } else {
            vec![files]
        };
        let outcome = self.agree(&dir, "writing the checkpoint", written.map(drop));
        if outcome.is_err() && self.is_main_process() {
            // Leave nothing half-written behind; the previous checkpoint stays the latest.
            let _ = std::fs::remove_dir_all(&partial);
        }
        outcome?;

        let committed = match self.is_main_process() {
            true => {
                let manifest = Manifest {
                    format_version: checkpoint::FORMAT_VERSION,
                    library_version: env!("CARGO_PKG_VERSION").to_string(),
                    world_size: self.state.world_size,
                    updates: self.shared.lock().accumulation.updates(),
                    files: all_files.into_iter().flatten().collect(),
                };
                checkpoint::commit(&dir, &partial, &manifest).map_err(|e| e.to_string())
            }
            false => Ok(()),
        };
        self.agree(&dir, "committing the checkpoint", committed)?;
        Ok(dir)
    }

    /// Writes this rank's files into `partial` and describes them for the manifest.
    fn write_own_files<M: Module>(
        &self,
        partial: &Path,
        checkpoint: &Checkpoint<'_, M>,
    ) -> Result<Vec<ManifestFile>, String> {
        let rank = self.state.rank;
        let mut files = Vec::new();
        let mut add = |name: &str, contents: &str, rank: Option<usize>, bytes: u64| {
            files.push(ManifestFile {
                name: name.to_string(),
                contents: contents.to_string(),
                rank,
                bytes,
            });
        };
        let state = {
            let shared = self.shared.lock();
            RankState {
                rank,
                world_size: self.state.world_size,
                updates: shared.accumulation.updates(),
                windows: shared.windows,
                seed: self.config.seed,
                scaler: shared.scaler.as_ref().map(|s| s.state()),
                loader: shared.train.as_ref().map(|link| {
                    let epoch_len = link.sampler.len_from_sample(link.start_sample);
                    // A finished epoch resumes at the start of the next one.
                    let (epoch, batches, start_sample) = if link.batches >= epoch_len {
                        (link.cursor_epoch + 1, 0, 0)
                    } else {
                        (link.cursor_epoch, link.batches, link.start_sample)
                    };
                    LoaderState {
                        cursor: SamplerCursor {
                            epoch,
                            batches_consumed: batches,
                        },
                        start_sample,
                        samples_consumed: (start_sample
                            + batches * link.sampler.global_batch_size())
                        .min(link.sampler.config().len),
                        sampler: link.sampler.config().clone(),
                    }
                }),
            }
        };
        let name = rank_file(rank);
        let bytes =
            checkpoint::write_json(&partial.join(&name), &state).map_err(|e| e.to_string())?;
        add(&name, "loop state of one process (JSON)", Some(rank), bytes);
        // A fused optimizer's state: every rank's shard with ZeRO, else the main process's.
        let fused_state = {
            let mut shared = self.shared.lock();
            shared.flat.as_mut().and_then(|engine| {
                let sharded = engine.zero_stage >= 1 && self.state.is_distributed();
                (sharded || self.is_main_process())
                    .then(|| engine.state_file())
                    .flatten()
            })
        };
        if let Some(state) = fused_state {
            let name = fused_file(rank);
            let bytes = checkpoint::write_synced(&partial.join(&name), &state.to_bytes())
                .map_err(|e| e.to_string())?;
            add(
                &name,
                "fused optimizer state of one shard (JSON header, f32 data)",
                Some(rank),
                bytes,
            );
        }
        if !self.is_main_process() {
            return Ok(files);
        }

        let path = partial.join(MODEL_FILE);
        let mut store = SafetensorsStore::from_file(&path).overwrite(true);
        checkpoint
            .model
            .save_into(&mut store)
            .map_err(|e| format!("model weights: {e}"))?;
        add(
            MODEL_FILE,
            "model weights (safetensors)",
            None,
            synced(&path)?,
        );

        if let Some(inner) = checkpoint.optimizer.inner() {
            let path = partial.join(OPTIMIZER_FILE);
            inner
                .to_record()
                .save(&path)
                .map_err(|e| format!("optimizer record: {e}"))?;
            add(
                OPTIMIZER_FILE,
                "optimizer record (burnpack)",
                None,
                synced(&path)?,
            );
        }

        if let Some(scheduler) = checkpoint.scheduler {
            let record = scheduler.record_at(state.updates).ok_or_else(|| {
                "the scheduler was stepped more than once past the latest update; \
                 hint: call sched.step() once per optimizer update"
                    .to_string()
            })?;
            let path = partial.join(SCHEDULER_FILE);
            record
                .save(&path)
                .map_err(|e| format!("scheduler record: {e}"))?;
            add(
                SCHEDULER_FILE,
                "learning-rate scheduler record (burnpack)",
                None,
                synced(&path)?,
            );
        }

        let mut objects = BTreeMap::new();
        for (name, write) in &checkpoint.objects {
            let value = write().map_err(|e| format!("object {name:?} does not serialise: {e}"))?;
            objects.insert(name.clone(), value);
        }
        let training = TrainingState {
            param_ids: param_ids(checkpoint.model),
            scheduler: checkpoint.scheduler.is_some(),
            objects,
        };
        let path = partial.join(TRAINING_STATE_FILE);
        let bytes = checkpoint::write_json(&path, &training).map_err(|e| e.to_string())?;
        add(
            TRAINING_STATE_FILE,
            "parameter ids and user objects (JSON)",
            None,
            bytes,
        );
        Ok(files)
    }

    /// Restores the state saved by [`save_state`](Self::save_state) in `dir` (every process
    /// must call it): returns `model` with the saved parameters, loads `optimizer` and
    /// `scheduler`, and moves the counters, the loss scaler, the random stream and the
    /// training loader to where the saved run stood. The training loader's next iteration of
    /// the saved epoch continues with the batch after the last one the saved run consumed.
    ///
    /// A checkpoint saved by another number of processes is an error unless the accelerator
    /// was built with [`resume_with_different_world_size`](crate::AcceleratorBuilder::resume_with_different_world_size).
    pub fn load_state<M: Module>(
        &self,
        dir: impl AsRef<Path>,
        model: M,
        optimizer: &mut PreparedOptimizer,
        scheduler: Option<&mut PreparedScheduler>,
    ) -> Result<Restored<M>, AccelerateError> {
        let dir = dir.as_ref().to_path_buf();
        let loaded = self.load_own_part(&dir, model, optimizer, scheduler);
        let outcome = loaded.as_ref().map(drop).map_err(ToString::to_string);
        let agreed = self.agree(&dir, "loading the checkpoint", outcome);
        let restored = loaded?;
        agreed?;
        Ok(restored)
    }

    fn load_own_part<M: Module>(
        &self,
        dir: &Path,
        model: M,
        optimizer: &mut PreparedOptimizer,
        scheduler: Option<&mut PreparedScheduler>,
    ) -> Result<Restored<M>, AccelerateError> {
        let rank = self.state.rank;
        let fail = |reason: String| self.checkpoint_error(dir, reason);
        let from_core = |e: CheckpointError| fail(e.to_string());
        let manifest = checkpoint::read_manifest(dir).map_err(from_core)?;
        let same_world = manifest.world_size == self.state.world_size;
        if !same_world && !self.resume_any_world_size {
            return Err(fail(format!(
                "it was saved by {} processes and this job has {}. hint: launch {} processes, \
                 or build the accelerator with .resume_with_different_world_size(true) to \
                 continue the saved epoch's order from its global position",
                manifest.world_size, self.state.world_size, manifest.world_size
            )));
        }
        let training: TrainingState =
            checkpoint::read_json(&dir.join(TRAINING_STATE_FILE)).map_err(from_core)?;
        let own = if same_world {
            rank_file(rank)
        } else {
            rank_file(0)
        };
        let saved: RankState = checkpoint::read_json(&dir.join(&own)).map_err(from_core)?;

        let mut model = model;
        let mut store = SafetensorsStore::from_file(dir.join(MODEL_FILE));
        let applied = model.load_from(&mut store).map_err(|e| {
            // Burn's message is a multi-line table; its first line says what went wrong.
            let e = e.to_string();
            let first = e
                .lines()
                .next()
                .unwrap_or_default()
                .trim_end_matches([':', ' ']);
            fail(format!(
                "{MODEL_FILE} does not fit this model ({first}). hint: build the model the \
                 checkpoint was saved from"
            ))
        })?;
        if !applied.errors.is_empty() || !applied.missing.is_empty() {
            let missing: Vec<&str> = applied.missing.iter().map(|(p, _)| p.as_str()).collect();
            return Err(fail(format!(
                "{MODEL_FILE} does not fit this model (missing: [{}], errors: {:?}). hint: \
                 build the model the checkpoint was saved from",
                missing.join(", "),
                applied.errors
            )));
        }
        let own_ids = param_ids(&model);
        if own_ids.len() != training.param_ids.len() {
            return Err(fail(format!(
                "the model has {} float parameters, the checkpoint {}",
                own_ids.len(),
                training.param_ids.len()
            )));
        }
        let model = set_param_ids(model, training.param_ids);

        let fused_files: Vec<&str> = manifest
            .files
            .iter()
            .map(|f| f.name.as_str())
            .filter(|name| name.starts_with(FUSED_PREFIX))
            .collect();
        if let Some(inner) = optimizer.inner_mut() {
            if !fused_files.is_empty() {
                return Err(fail(
                    "it holds a fused optimizer's state. hint: prepare the same fused \
                     optimizer (FusedOptimizer::...) to resume from it"
                        .into(),
                ));
            }
            let record = OptimizerRecord::load(dir.join(OPTIMIZER_FILE))
                .map_err(|e| fail(format!("{OPTIMIZER_FILE}: {e}")))?;
            *inner = inner.clone().load_record(record);
        } else {
            let has_burn_record = manifest.files.iter().any(|f| f.name == OPTIMIZER_FILE);
            if has_burn_record {
                return Err(fail(
                    "it holds Burn's optimizer record, this run uses a fused optimizer. \
                     hint: resume with the optimizer it was saved with"
                        .into(),
                ));
            }
            let mut states = Vec::new();
            for name in fused_files {
                let bytes =
                    std::fs::read(dir.join(name)).map_err(|e| fail(format!("{name}: {e}")))?;
                states.push(
                    FusedStateFile::from_bytes(&bytes).map_err(|e| fail(format!("{name}: {e}")))?,
                );
            }
            let mut shared = self.shared.lock();
            if let Some(engine) = shared.flat.as_mut() {
                // Rebuilt from the loaded model at the next window, with this state.
                engine.layout = None;
                engine.pending = (!states.is_empty()).then_some(states);
            }
        }
        match (scheduler, training.scheduler) {
            (Some(scheduler), true) => {
                let record = LrSchedulerRecord::load(dir.join(SCHEDULER_FILE))
                    .map_err(|e| fail(format!("{SCHEDULER_FILE}: {e}")))?;
                scheduler.restore(record, saved.updates);
            }
            (Some(_), false) => {
                return Err(fail(
                    "a scheduler was given but the checkpoint has none. hint: pass None, or \
                     save with Checkpoint::scheduler"
                        .into(),
                ));
            }
            (None, _) => {}
        }

        let mut shared = self.shared.lock();
        shared.accumulation.restore(saved.updates);
        shared.accumulated = None;
        shared.step_skipped = false;
        shared.windows = saved.windows;
        match (shared.scaler.as_mut(), saved.scaler) {
            (Some(scaler), Some(state)) => scaler.load_state(state),
            (None, None) => {}
            (now, _) => tracing::warn!(
                "the checkpoint was saved {} fp16 loss scaling and this run is {}: the loss \
                 scale starts afresh",
                if now.is_some() { "without" } else { "with" },
                if now.is_some() { "fp16" } else { "not" },
            ),
        }
        if let Some(seed) = self.config.seed {
            self.device.seed(window_seed(seed, rank, saved.windows));
        }
        if let Some(loader) = saved.loader {
            let skip = if same_world && loader.start_sample == 0 {
                Skip::Batches(loader.cursor.batches_consumed)
            } else {
                Skip::Samples(loader.samples_consumed)
            };
            let point = ResumePoint {
                checkpoint: dir.to_path_buf(),
                sampler: loader.sampler,
                epoch: loader.cursor.epoch,
                skip,
            };
            // A loader prepared later takes the point when it is prepared.
            if let Some(link) = shared.train.as_ref() {
                link.attach(&point).map_err(fail)?;
            }
            shared.resume = Some(point);
        }
        drop(shared);
        tracing::info!(rank, path = %dir.display(), updates = saved.updates, "checkpoint loaded");
        Ok(Restored {
            model,
            info: CheckpointInfo {
                path: Some(dir.to_path_buf()),
                updates: saved.updates,
                rank,
                objects: training.objects,
            },
        })
    }

    /// The project's automatically named checkpoints (needs
    /// [`project_dir`](crate::AcceleratorBuilder::project_dir)).
    fn rotation(&self) -> Result<CheckpointRotation, AccelerateError> {
        match &self.project_dir {
            Some(dir) => Ok(CheckpointRotation::new(dir, self.checkpoint_total_limit)),
            None => Err(self.checkpoint_error(
                Path::new(""),
                "no project directory for automatically named checkpoints. hint: build the \
                 accelerator with .project_dir(path), or call save_state with a directory",
            )),
        }
    }

    /// Saves into `<project_dir>/checkpoints/checkpoint_<updates>` and then removes the oldest
    /// checkpoints beyond the total limit. Returns the new checkpoint's directory.
    pub fn save_checkpoint<M: Module>(
        &self,
        checkpoint: &Checkpoint<'_, M>,
    ) -> Result<PathBuf, AccelerateError> {
        let rotation = self.rotation()?;
        let updates = self.shared.lock().accumulation.updates();
        let dir = self.save_state(rotation.path_for(updates), checkpoint)?;
        if self.is_main_process() {
            rotation
                .rotate()
                .map_err(|e| self.checkpoint_error(&rotation.root, e.to_string()))?;
        }
        Ok(dir)
    }

    /// Loads the newest complete checkpoint of the project, if there is one; otherwise returns
    /// `model` untouched with [`CheckpointInfo::path`] `None` (a fresh start). Incomplete
    /// directories that crashed saves left are never considered.
    pub fn load_latest_checkpoint<M: Module>(
        &self,
        model: M,
        optimizer: &mut PreparedOptimizer,
        scheduler: Option<&mut PreparedScheduler>,
    ) -> Result<Restored<M>, AccelerateError> {
        let rotation = self.rotation()?;
        // The main process decides, so that every process loads the same one.
        let latest = rotation.latest();
        let latest: Option<PathBuf> = if self.state.is_distributed() {
            self.group().broadcast_object(Some(&latest), 0)?
        } else {
            latest
        };
        match latest {
            Some(dir) => self.load_state(dir, model, optimizer, scheduler),
            None => Ok(Restored {
                model,
                info: CheckpointInfo {
                    path: None,
                    updates: 0,
                    rank: self.state.rank,
                    objects: BTreeMap::new(),
                },
            }),
        }
    }
}

/// Syncs a file Burn wrote and returns its size.
fn synced(path: &Path) -> Result<u64, String> {
    checkpoint::sync_file(path).map_err(|e| e.to_string())
}
