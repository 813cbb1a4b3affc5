//! Saving: every rank writes its part into `<dir>.partial`, the file lists are gathered, every
//! rank's outcome is agreed, and only then the main process writes the manifest and renames
//! the directory into place.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use accelerate_core::checkpoint::{self, Manifest, ManifestFile, RankState};
use burn::module::Module;
use burn::store::{ModuleSnapshot, SafetensorsStore};

use super::{
    Checkpoint, Context, MODEL_FILE, PairState, SCHEDULER_FILE, StageError, TRAINING_STATE_FILE,
    TrainingState, rank_file,
};
use crate::error::AccelerateError;
use crate::optim::PreparedScheduler;
use crate::params::{self, ParamLayout};
use crate::reducer::SaveRole;
use crate::reducer::sharded_files;

/// Saves the whole training state into `dir` (see [`crate::Accelerator::save_state`]).
pub(crate) fn save_state<M: Module>(
    ctx: &Context<'_>,
    dir: &Path,
    checkpoint: &Checkpoint<'_, M>,
) -> Result<PathBuf, AccelerateError> {
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

    let written = write_own_files(ctx, &partial, checkpoint);
    let files = match &written {
        Ok(files) => files.clone(),
        Err(_) => Vec::new(),
    };
    let all_files: Vec<Vec<ManifestFile>> = if ctx.comm.is_distributed() {
        ctx.comm.lock().all_gather_object(&files)?
    } else {
        vec![files]
    };
    let outcome = ctx.agree(dir, "writing the checkpoint", written.map(drop));
    if outcome.is_err() && ctx.state.is_main_process() {
        // Leave nothing half-written behind; the previous checkpoint stays the latest.
        let _ = std::fs::remove_dir_all(&partial);
    }
    outcome?;

    let committed = match ctx.state.is_main_process() {
        true => {
            let manifest = Manifest {
                format_version: checkpoint::FORMAT_VERSION,
                library_version: env!("CARGO_PKG_VERSION").to_string(),
                world_size: ctx.state.world_size,
                updates: checkpoint.optimizer.slot().lock().windows.updates(),
                sequence: 0,
                files: all_files.into_iter().flatten().collect(),
            };
            checkpoint::commit(dir, &partial, manifest)
        }
        false => Ok(()),
    };
    ctx.agree(dir, "committing the checkpoint", committed)?;
    Ok(dir.to_path_buf())
}

/// Writes this rank's files into `partial` and describes them for the manifest.
fn write_own_files<M: Module>(
    ctx: &Context<'_>,
    partial: &Path,
    checkpoint: &Checkpoint<'_, M>,
) -> Result<Vec<ManifestFile>, StageError> {
    let rank = ctx.state.rank;
    let main = ctx.state.is_main_process();
    let mut files = Vec::new();
    let mut add = |name: &str, contents: &str, rank: Option<usize>, bytes: u64| {
        files.push(ManifestFile {
            name: name.to_string(),
            contents: contents.to_string(),
            rank,
            bytes,
        });
    };
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
        let values = (part.values)();
        let prefix = sharded_files::module_prefix(&part.name);
        let job = (rank, ctx.state.world_size);
        let file =
            sharded_files::write_model(partial, &prefix, job, &part.layout, values, &numels)?;
        add(
            &file.name,
            "one rank's shards of a module saved beside the model",
            file.rank,
            file.bytes,
        );
        sharded_modules.push(part.name.as_str());
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
        models,
    };
    let name = rank_file(rank);
    let bytes = checkpoint::write_json(&partial.join(&name), &state)?;
    add(&name, "loop state of one process (JSON)", Some(rank), bytes);

    let role = SaveRole {
        rank,
        main,
        distributed: ctx.comm.is_distributed(),
    };
    let (kind, shard_numels) = {
        let mut slot = checkpoint.optimizer.slot().lock();
        for file in slot.reducer.save(partial, role)? {
            add(&file.name, file.contents, file.rank, file.bytes);
        }
        let numels = slot.reducer.shard_numels().map(<[_]>::to_vec);
        (slot.reducer.kind(), numels)
    };
    // ZeRO-3: every rank writes its own shards of the model; nobody holds it whole.
    if let Some(numels) = &shard_numels {
        let layout = ParamLayout::of(checkpoint.model);
        let values = params::values(checkpoint.model);
        let job = (rank, ctx.state.world_size);
        let prefix = sharded_files::MODEL_PREFIX;
        let file = sharded_files::write_model(partial, prefix, job, &layout, values, numels)?;
        add(&file.name, file.contents, file.rank, file.bytes);
    }
    let mut pairs = BTreeMap::new();
    for pair in &checkpoint.pairs {
        let dir = partial.join(&pair.name);
        std::fs::create_dir_all(&dir).map_err(|source| StageError::Io {
            path: dir.clone(),
            source,
        })?;
        let mut slot = pair.optimizer.slot().lock();
        for file in slot.reducer.save(&dir, role)? {
            let name = format!("{}/{}", pair.name, file.name);
            add(&name, file.contents, file.rank, file.bytes);
        }
        // With sharded units every rank writes its shards of the pair's model.
        let shard_numels = slot.reducer.shard_numels().map(<[_]>::to_vec);
        if let Some(numels) = &shard_numels {
            let values = (pair.values)();
            let prefix = sharded_files::MODEL_PREFIX;
            let job = (rank, ctx.state.world_size);
            let file = sharded_files::write_model(&dir, prefix, job, &pair.layout, values, numels)?;
            let name = format!("{}/{}", pair.name, file.name);
            add(&name, file.contents, file.rank, file.bytes);
        }
        if main && shard_numels.is_none() {
            let path = dir.join(MODEL_FILE);
            (pair.write_model)(&path).map_err(|e| StageError::Burn {
                what: format!("{} weights", pair.name),
                detail: e.to_string(),
            })?;
            let name = format!("{}/{MODEL_FILE}", pair.name);
            add(
                &name,
                "weights of a model trained beside the main one",
                None,
                synced(&path)?,
            );
        }
        if main {
            if let Some(scheduler) = pair.scheduler {
                let updates = state.models.get(&pair.name).map_or(0, |m| m.updates);
                let path = save_scheduler(scheduler, updates, &dir)?;
                let name = format!("{}/{SCHEDULER_FILE}", pair.name);
                add(
                    &name,
                    "learning-rate scheduler record (burnpack)",
                    None,
                    synced(&path)?,
                );
            }
            let saved = PairState {
                param_ids: pair.param_ids.clone(),
                optimizer: slot.reducer.kind().to_string(),
                scheduler: pair.scheduler.is_some(),
            };
            pairs.insert(pair.name.clone(), saved);
        }
        checkpoint::sync_dir(&dir)?;
    }
    if !main {
        return Ok(files);
    }

    if shard_numels.is_none() {
        let path = partial.join(MODEL_FILE);
        let mut store = SafetensorsStore::from_file(&path).overwrite(true);
        checkpoint
            .model
            .save_into(&mut store)
            .map_err(|e| StageError::Burn {
                what: "model weights".into(),
                detail: e.to_string(),
            })?;
        add(
            MODEL_FILE,
            "model weights (safetensors)",
            None,
            synced(&path)?,
        );
    }

    for part in &checkpoint.modules {
        let (name, write) = (&part.name, &part.write);
        if sharded_modules.contains(&name.as_str()) {
            continue;
        }
        if !super::valid_module_name(name) {
            return Err(StageError::ModuleName(name.clone()));
        }
        let file = super::module_file(name);
        let path = partial.join(&file);
        write(&path).map_err(|e| StageError::Burn {
            what: format!("module {name:?}"),
            detail: e.to_string(),
        })?;
        add(
            &file,
            "weights of a module saved beside the model (safetensors)",
            None,
            synced(&path)?,
        );
    }

    if let Some(scheduler) = checkpoint.scheduler {
        let path = save_scheduler(scheduler, updates, partial)?;
        add(
            SCHEDULER_FILE,
            "learning-rate scheduler record (burnpack)",
            None,
            synced(&path)?,
        );
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
    let path = partial.join(TRAINING_STATE_FILE);
    let bytes = checkpoint::write_json(&path, &training)?;
    add(
        TRAINING_STATE_FILE,
        "parameter ids, optimizer kind and user objects (JSON)",
        None,
        bytes,
    );
    Ok(files)
}

/// Syncs a file Burn wrote and returns its size.
fn synced(path: &Path) -> Result<u64, StageError> {
    Ok(checkpoint::sync_file(path)?)
}

/// Writes `scheduler`'s record after `updates` updates into `dir`; returns the file's path.
fn save_scheduler(
    scheduler: &PreparedScheduler,
    updates: u64,
    dir: &Path,
) -> Result<PathBuf, StageError> {
    let record = scheduler
        .record_at(updates)
        .ok_or(StageError::SchedulerAhead)?;
    let path = dir.join(SCHEDULER_FILE);
    record.save(&path).map_err(|e| StageError::Burn {
        what: "scheduler record".into(),
        detail: e.to_string(),
    })?;
    Ok(path)
}
