//! Saving: every rank stages its part of `<dir>.partial` (written now, or snapshotted for the
//! background thread), the file lists are gathered, every rank's outcome is agreed, and only
//! then the main process writes the manifest and renames the directory into place (at once,
//! or in the background once every rank's files are on disk: see [`super::background`]).

use std::collections::BTreeMap;
use std::path::Path;

use accelerate_core::checkpoint::{self, CheckpointRotation, Manifest, ManifestFile, RankState};
use burn::module::Module;
use serde::Serialize;

use super::background::{self, BackgroundSave, CommitJob};
use super::staging::{CheckpointSnapshot, StageMode, Staging};
use super::{
    Checkpoint, Context, MODEL_FILE, PairState, SCHEDULER_FILE, StageError, TRAINING_STATE_FILE,
    TrainingState, rank_file,
};
use crate::error::AccelerateError;
use crate::optim::PreparedScheduler;
use crate::params::{self, ParamLayout};
use crate::reducer::sharded_files;
use crate::reducer::{SaveRole, SavedFile};

/// How a save runs: synchronously, or staged for the background thread (with the rotation
/// that follows an automatically named checkpoint).
pub(crate) enum SaveMode {
    /// Every file written and committed before the call returns.
    Now,
    /// A snapshot taken here, written and committed in the background.
    Background {
        snapshot: CheckpointSnapshot,
        rotation: Option<CheckpointRotation>,
    },
}

/// Saves the whole training state into `dir` (see [`crate::Accelerator::save_state`]); in the
/// background, returns the save in flight.
pub(crate) fn save_state<M: Module>(
    ctx: &Context<'_>,
    dir: &Path,
    checkpoint: &Checkpoint<'_, M>,
    mode: SaveMode,
) -> Result<Option<BackgroundSave>, AccelerateError> {
    let rank = ctx.state.rank;
    let (pending, steps) = (ctx.slots.pending(), ctx.slots.accumulation_steps());
    if pending > 0 {
        return Err(AccelerateError::Misuse {
            rank,
            what: format!(
                "saving checkpoint {} in the middle of an accumulation window ({pending} of \
                 {steps} micro-batches summed, which a checkpoint does not hold)",
                dir.display()
            ),
            hint: "save after an optimizer update, when acc.sync_gradients() is true",
        });
    }
    let partial = checkpoint::partial_dir(dir);
    let begun = match ctx.state.is_main_process() {
        true => checkpoint::begin_save(dir).map(drop),
        false => Ok(()),
    };
    ctx.agree(dir, "starting the save", begun)?;

    let stage_mode = match &mode {
        SaveMode::Now => StageMode::Now,
        SaveMode::Background { snapshot, .. } => StageMode::Snapshot(*snapshot),
    };
    let mut staging = Staging::new(&partial, stage_mode);
    let written = write_own_files(ctx, &mut staging, checkpoint);
    let (files, pending) = staging.finish();
    // Synchronous: the files are synced; their directories are synced here.
    let (written, pending) = match stage_mode {
        StageMode::Now => (
            written.and_then(|()| pending.make_durable(|_| Ok(()))),
            None,
        ),
        StageMode::Snapshot(_) => (written, Some(pending)),
    };
    let files = if written.is_ok() { files } else { Vec::new() };
    let all_files: Vec<Vec<ManifestFile>> = if ctx.comm.is_distributed() {
        ctx.comm.lock().all_gather_object(&files)?
    } else {
        vec![files]
    };
    let stage = match mode {
        SaveMode::Now => "writing the checkpoint",
        SaveMode::Background { .. } => "taking the checkpoint's snapshot",
    };
    let outcome = ctx.agree(dir, stage, written);
    if outcome.is_err() && ctx.state.is_main_process() {
        // Leave nothing half-written behind; the previous checkpoint stays the latest.
        let _ = std::fs::remove_dir_all(&partial);
    }
    outcome?;

    let manifest = Manifest {
        format_version: checkpoint::FORMAT_VERSION,
        library_version: env!("CARGO_PKG_VERSION").to_string(),
        world_size: ctx.state.world_size,
        updates: checkpoint.optimizer.slot().lock().windows.updates(),
        sequence: 0,
        files: all_files.into_iter().flatten().collect(),
    };
    if let (SaveMode::Background { rotation, .. }, Some(pending)) = (mode, pending) {
        let commit = ctx.state.is_main_process().then(|| CommitJob {
            dir: dir.to_path_buf(),
            partial: partial.clone(),
            manifest,
            world_size: ctx.state.world_size,
            rotation,
        });
        let started = background::start(rank, dir.to_path_buf(), partial.clone(), pending, commit);
        // A rank that could not start its writer fails every rank's save now.
        let (save, mine) = match started {
            Ok(save) => (Some(save), Ok(())),
            Err(e) => (None, Err(format!("{}: {e}", partial.display()))),
        };
        if let Err(e) = ctx.agree(dir, "starting the background writer", mine) {
            if let Some(save) = save {
                save.abandon();
            }
            return Err(e);
        }
        return Ok(save);
    }
    let committed = match ctx.state.is_main_process() {
        true => checkpoint::commit(dir, &partial, manifest),
        false => Ok(()),
    };
    ctx.agree(dir, "committing the checkpoint", committed)?;
    Ok(None)
}

/// Stages this rank's files (their manifest entries come from `staging`).
fn write_own_files<M: Module>(
    ctx: &Context<'_>,
    staging: &mut Staging,
    checkpoint: &Checkpoint<'_, M>,
) -> Result<(), StageError> {
    let rank = ctx.state.rank;
    let main = ctx.state.is_main_process();
    // Shard files are named by the rank in the shard group (the job's, without hybrid
    // sharding), and under hybrid sharding written by the first shard group only.
    let job = ctx.shards.shard_job();
    let writes_shards = ctx.shards.writes_shards();
    let names: Vec<&str> = checkpoint.pairs.iter().map(|p| p.name.as_str()).collect();
    if let Some(name) = names
        .iter()
        .enumerate()
        .find_map(|(i, n)| (!super::valid_module_name(n) || names[..i].contains(n)).then_some(n))
    {
        return Err(StageError::PairName(name.to_string()));
    }
    // A module with sharded units (ZeRO-3): every rank writes its shards of it, as of the
    // model; the others are written whole by the main process below.
    let mut sharded_modules = Vec::new();
    for part in &checkpoint.modules {
        let numels = ctx.shards.numels(&part.layout);
        if numels.iter().all(Option::is_none) {
            continue;
        }
        if !super::valid_module_name(&part.name) {
            return Err(StageError::ModuleName(part.name.clone()));
        }
        sharded_modules.push(part.name.as_str());
        if !writes_shards {
            continue;
        }
        let values = (part.values)();
        let prefix = sharded_files::module_prefix(&part.name);
        let mut file = sharded_files::model_file(&prefix, job, &part.layout, values, &numels)?;
        file.contents = "one rank's shards of a module saved beside the model";
        staging.put(file)?;
    }
    let snapshot = checkpoint.optimizer.slot().lock().windows.snapshot();
    let models = checkpoint
        .pairs
        .iter()
        .map(|pair| {
            let snapshot = pair.optimizer.slot().lock().windows.snapshot();
            (pair.name.clone(), snapshot)
        })
        .collect();
    let updates = snapshot.updates;
    let state = RankState {
        rank,
        world_size: ctx.state.world_size,
        updates: snapshot.updates,
        windows: snapshot.windows,
        seed: ctx.seed,
        scaler: snapshot.scaler,
        loader: ctx.links.saved_state(),
        stream: ctx.links.saved_stream(),
        models,
    };
    staging.put(json_file(
        rank_file(rank),
        "loop state of one process (JSON)",
        Some(rank),
        &state,
    )?)?;

    let role = SaveRole {
        rank,
        main,
        distributed: ctx.comm.is_distributed(),
    };
    let (kind, shard_numels) = {
        let mut slot = checkpoint.optimizer.slot().lock();
        for file in slot.reducer.save(role)? {
            staging.put(file)?;
        }
        let numels = slot.reducer.shard_numels().map(<[_]>::to_vec);
        (slot.reducer.kind(), numels)
    };
    // ZeRO-3: every rank writes its own shards of the model; nobody holds it whole.
    if let Some(numels) = shard_numels.as_ref().filter(|_| writes_shards) {
        let layout = ParamLayout::of(checkpoint.model);
        let values = params::values(checkpoint.model);
        let prefix = sharded_files::MODEL_PREFIX;
        staging.put(sharded_files::model_file(
            prefix, job, &layout, values, numels,
        )?)?;
    }
    let mut pairs = BTreeMap::new();
    for pair in &checkpoint.pairs {
        let in_pair = |mut file: SavedFile| {
            file.name = format!("{}/{}", pair.name, file.name);
            file
        };
        let mut slot = pair.optimizer.slot().lock();
        for file in slot.reducer.save(role)? {
            staging.put(in_pair(file))?;
        }
        // With sharded units every rank writes its shards of the pair's model.
        let shard_numels = slot.reducer.shard_numels().map(<[_]>::to_vec);
        if let Some(numels) = shard_numels.as_ref().filter(|_| writes_shards) {
            let values = (pair.values)();
            let prefix = sharded_files::MODEL_PREFIX;
            let file = sharded_files::model_file(prefix, job, &pair.layout, values, numels)?;
            staging.put(in_pair(file))?;
        }
        if main && shard_numels.is_none() {
            staging.put_safetensors(
                &format!("{}/{MODEL_FILE}", pair.name),
                "weights of a model trained beside the main one",
                &pair.write_model,
            )?;
        }
        if main {
            if let Some(scheduler) = pair.scheduler {
                let updates = state.models.get(&pair.name).map_or(0, |m| m.updates);
                staging.put(in_pair(scheduler_file(scheduler, updates)?))?;
            }
            let saved = PairState {
                param_ids: pair.param_ids.clone(),
                optimizer: slot.reducer.kind().to_string(),
                scheduler: pair.scheduler.is_some(),
            };
            pairs.insert(pair.name.clone(), saved);
        }
    }
    if !main {
        return Ok(());
    }

    if shard_numels.is_none() {
        let model = super::module_writer(checkpoint.model);
        staging.put_safetensors(MODEL_FILE, "model weights (safetensors)", &model)?;
    }

    for part in &checkpoint.modules {
        let (name, write) = (&part.name, &part.write);
        if sharded_modules.contains(&name.as_str()) {
            continue;
        }
        if !super::valid_module_name(name) {
            return Err(StageError::ModuleName(name.clone()));
        }
        staging.put_safetensors(
            &super::module_file(name),
            "weights of a module saved beside the model (safetensors)",
            write,
        )?;
    }

    if let Some(scheduler) = checkpoint.scheduler {
        staging.put(scheduler_file(scheduler, updates)?)?;
    }

    let mut objects = BTreeMap::new();
    for (name, write) in &checkpoint.objects {
        let value = write().map_err(|source| StageError::Object {
            name: name.clone(),
            source,
        })?;
        objects.insert(name.clone(), value);
    }
    let training = TrainingState {
        param_ids: ParamLayout::of(checkpoint.model).ids(),
        optimizer: Some(kind.to_string()),
        scheduler: checkpoint.scheduler.is_some(),
        objects,
        pairs,
    };
    staging.put(json_file(
        TRAINING_STATE_FILE.into(),
        "parameter ids, optimizer kind and user objects (JSON)",
        None,
        &training,
    )?)
}

/// `value` as a JSON file of the checkpoint.
fn json_file<T: Serialize>(
    name: String,
    contents: &'static str,
    rank: Option<usize>,
    value: &T,
) -> Result<SavedFile, StageError> {
    let data = serde_json::to_vec_pretty(value).map_err(|e| StageError::Burn {
        what: name.clone(),
        detail: e.to_string(),
    })?;
    Ok(SavedFile {
        name,
        contents,
        rank,
        data,
    })
}

/// `scheduler`'s record after `updates` updates, as its file.
fn scheduler_file(scheduler: &PreparedScheduler, updates: u64) -> Result<SavedFile, StageError> {
    let record = scheduler
        .record_at(updates)
        .ok_or(StageError::SchedulerAhead)?;
    let data = record.into_bytes().map_err(|e| StageError::Burn {
        what: "scheduler record".into(),
        detail: e.to_string(),
    })?;
    Ok(SavedFile {
        name: SCHEDULER_FILE.into(),
        contents: "learning-rate scheduler record (burnpack)",
        rank: None,
        data: data.to_vec(),
    })
}
