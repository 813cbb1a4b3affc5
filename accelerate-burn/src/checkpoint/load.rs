//! Loading: the manifest and the main process's files say what was saved; the model is loaded
//! and given the saved parameter ids; then each component restores its own part (reducer,
//! scheduler, loop counters, training loader). Every rank's outcome is agreed.

use std::path::Path;

use accelerate_core::checkpoint::{self, Manifest, ManifestFile, ModelLoopState, RankState};
use accelerate_core::{CheckpointError, StreamState};
use burn::lr_scheduler::LrSchedulerRecord;
use burn::module::{Module, ParamId};

use super::{
    CheckpointInfo, Context, MODEL_FILE, Restored, SCHEDULER_FILE, SavedShards,
    TRAINING_STATE_FILE, TrainingState, rank_file,
};
use crate::error::AccelerateError;
use crate::optim::{PreparedOptimizer, PreparedScheduler};
use crate::params::{self, ParamLayout, Replacement};
use crate::reducer::LoadSource;
use crate::reducer::sharded_files;

/// Restores the state saved in `dir` (see [`crate::Accelerator::load_state`]).
pub(crate) fn load_state<M: Module>(
    ctx: &Context<'_>,
    dir: &Path,
    model: M,
    optimizer: &mut PreparedOptimizer,
    scheduler: Option<&mut PreparedScheduler>,
) -> Result<Restored<M>, AccelerateError> {
    // A save that crashed mid-swap left the previous checkpoint at `<dir>.old`.
    let dir = &checkpoint::locate(dir);
    let loaded = load_own_part(ctx, dir, model, optimizer, scheduler);
    agreed(ctx, dir, "loading the checkpoint", loaded)
}

/// This rank's `loaded`, once every rank has said how its own load went: a failure anywhere
/// fails every rank (naming the ranks), so none trains on with a half-restored state.
fn agreed<T>(
    ctx: &Context<'_>,
    dir: &Path,
    stage: &'static str,
    loaded: Result<T, AccelerateError>,
) -> Result<T, AccelerateError> {
    let outcome = loaded.as_ref().map(drop);
    let agreed = ctx.agree(dir, stage, outcome);
    let loaded = loaded?;
    agreed?;
    Ok(loaded)
}

fn load_own_part<M: Module>(
    ctx: &Context<'_>,
    dir: &Path,
    model: M,
    optimizer: &mut PreparedOptimizer,
    scheduler: Option<&mut PreparedScheduler>,
) -> Result<Restored<M>, AccelerateError> {
    let rank = ctx.state.rank;
    let mismatch = mismatch(rank, dir);
    let Saved {
        manifest,
        training,
        saved,
        same_world,
    } = read_saved(ctx, dir)?;
    if !same_world && !ctx.resume_any_world_size {
        return Err(mismatch(
            format!(
                "it was saved by {} processes and this job has {}",
                manifest.world_size, ctx.state.world_size
            ),
            "launch as many processes as saved it, or build the accelerator with \
             .resume_with_different_world_size(true) to continue the saved epoch's order from \
             its global position",
        ));
    }

    let model = restore_model_and_optimizer(
        ctx,
        dir,
        &manifest.files,
        model,
        optimizer,
        &training.param_ids,
        training.optimizer.as_deref(),
    )
    .map_err(|(detail, hint)| mismatch(detail, hint))?;
    restore_scheduler(dir, scheduler, training.scheduler, saved.updates)
        .map_err(|(detail, hint)| mismatch(detail, hint))?;

    optimizer.slot().lock().windows.restore(
        ModelLoopState {
            updates: saved.updates,
            windows: saved.windows,
            scaler: saved.scaler,
        },
        ctx.device,
    );
    if saved.stream.is_some() {
        let streams = saved_streams(dir, &manifest, saved.stream.clone(), same_world, rank)?;
        ctx.links.restore_stream(
            streams,
            (manifest.world_size, ctx.state.world_size),
            dir.to_path_buf(),
            rank,
        )?;
    }
    if let Some(loader) = saved.loader {
        ctx.links.restore(
            loader,
            (manifest.world_size, ctx.state.world_size),
            dir.to_path_buf(),
            rank,
        )?;
    }
    tracing::info!(rank, path = %dir.display(), updates = saved.updates, "checkpoint loaded");
    let mut info = CheckpointInfo::fresh(rank);
    info.sharding = Some(ctx.shards.clone());
    info.path = Some(dir.to_path_buf());
    info.updates = saved.updates;
    info.objects = training.objects;
    Ok(Restored { model, info })
}

/// `model` with the weights saved in `dir` (the checkpoint, or a pair's directory in it) under
/// the saved `param_ids`, and `optimizer`'s reducer continuing from the state in `files`
/// (names relative to `dir`); on failure, what does not fit and a hint.
fn restore_model_and_optimizer<M: Module>(
    ctx: &Context<'_>,
    dir: &Path,
    files: &[ManifestFile],
    model: M,
    optimizer: &mut PreparedOptimizer,
    param_ids: &[u64],
    saved_kind: Option<&str>,
) -> Result<M, (String, &'static str)> {
    let hint = "build the model the checkpoint was saved from";
    let shard_numels = optimizer
        .slot()
        .lock()
        .reducer
        .shard_numels()
        .map(<[_]>::to_vec);
    let sharded = sharded_files::has_shards(files, sharded_files::MODEL_PREFIX);
    let model = match (sharded, shard_numels) {
        (false, None) => {
            super::load_weights(model, &dir.join(MODEL_FILE)).map_err(|e| (e.to_string(), hint))?
        }
        (true, Some(numels)) => sharded_model(ctx, dir, files, model, &numels, param_ids)?,
        (true, None) => {
            return Err((
                "it was saved at ZeRO-3, with sharded units, and this run's model has none".into(),
                "resume at zero_stage 3 with the model's units sharded as they were saved",
            ));
        }
        (false, Some(_)) => {
            return Err((
                "it was saved without sharded units and this run's model has them".into(),
                "resume at the zero_stage the checkpoint was saved at",
            ));
        }
    };
    let layout = ParamLayout::of(&model);
    if layout.entries.len() != param_ids.len() {
        return Err((
            format!(
                "the model has {} float parameters, the checkpoint {}",
                layout.entries.len(),
                param_ids.len()
            ),
            hint,
        ));
    }
    let model = params::replace(
        model,
        Replacement {
            values: Vec::new(),
            ids: param_ids.to_vec(),
        },
    );
    let layout = layout.with_ids(param_ids);

    let mut slot = optimizer.slot().lock();
    let reducer = &mut slot.reducer;
    if let Some(saved_kind) = saved_kind
        && saved_kind != reducer.kind().name()
    {
        return Err((
            format!(
                "it holds the state of a {saved_kind} optimizer and this run prepared a {} one",
                reducer.kind()
            ),
            "prepare the optimizer the checkpoint was saved with (`fused`: Burn's config or \
             FusedOptimizer::...; `burn`: config.init())",
        ));
    }
    let loaded = reducer.load(LoadSource {
        dir,
        files,
        values: params::values(&model),
        layout,
    });
    drop(slot);
    // The reducer's layout now has the saved ids (also when its load stopped half-way):
    // `backward` finds the model under them.
    ctx.slots.refile(optimizer.slot());
    loaded.map_err(|e| {
        (
            e.to_string(),
            "resume with the optimizer the checkpoint was saved with",
        )
    })?;
    Ok(model)
}

/// `model` with this rank's values from a ZeRO-3 checkpoint (of any world size): each shard
/// cut for this job from the saved ranks' shards, the whole parameters as saved; its shards
/// are known under the saved ids from now on.
fn sharded_model<M: Module>(
    ctx: &Context<'_>,
    dir: &Path,
    files: &[ManifestFile],
    model: M,
    numels: &[Option<usize>],
    param_ids: &[u64],
) -> Result<M, (String, &'static str)> {
    let hint = "build the model the checkpoint was saved from, with the same units sharded";
    let layout = ParamLayout::of(&model);
    let saved = SavedShards {
        dir,
        prefix: sharded_files::MODEL_PREFIX,
        files,
        job: ctx.shards.shard_job(),
    };
    let model = saved
        .load_into(model, &layout, numels, ctx.device)
        .map_err(|e| (e.to_string(), hint))?;
    // The shards go on under the saved ids.
    for (entry, &id) in layout.entries.iter().zip(param_ids) {
        ctx.shards.rename(entry.id, ParamId::from(id));
    }
    Ok(model)
}

/// Restores the model and optimizer saved under `name` with [`super::Checkpoint::pair`] in
/// `dir`, and their loop counters (see [`crate::Accelerator::load_pair`]).
pub(crate) fn load_pair<M: Module>(
    ctx: &Context<'_>,
    dir: &Path,
    name: &str,
    (model, optimizer, scheduler): (M, &mut PreparedOptimizer, Option<&mut PreparedScheduler>),
) -> Result<M, AccelerateError> {
    let loaded = load_own_pair(ctx, dir, name, (model, optimizer, scheduler));
    agreed(ctx, dir, "loading a model saved with its optimizer", loaded)
}

fn load_own_pair<M: Module>(
    ctx: &Context<'_>,
    dir: &Path,
    name: &str,
    (model, optimizer, scheduler): (M, &mut PreparedOptimizer, Option<&mut PreparedScheduler>),
) -> Result<M, AccelerateError> {
    let mismatch = mismatch(ctx.state.rank, dir);
    if !super::valid_module_name(name) {
        return Err(mismatch(
            format!(
                "{name:?} is not a pair name (letters, digits, - and _, not beginning with \
                 zero3_, fused_optimizer_ or rank_)"
            ),
            "load the pairs the checkpoint was saved with, under the names it used",
        ));
    }
    let Saved {
        manifest,
        training,
        saved,
        ..
    } = read_saved(ctx, dir)?;
    let (Some(pair), Some(state)) = (training.pairs.get(name), saved.models.get(name)) else {
        let saved: Vec<&String> = training.pairs.keys().collect();
        return Err(mismatch(
            format!("it holds no model saved with its optimizer as {name:?} (it has {saved:?})"),
            "load the pairs the checkpoint was saved with, under the names it used",
        ));
    };
    let prefix = format!("{name}/");
    let files: Vec<ManifestFile> = manifest
        .files
        .iter()
        .filter_map(|f| {
            let inner = f.name.strip_prefix(&prefix)?;
            Some(ManifestFile {
                name: inner.to_string(),
                ..f.clone()
            })
        })
        .collect();
    let model = restore_model_and_optimizer(
        ctx,
        &dir.join(name),
        &files,
        model,
        optimizer,
        &pair.param_ids,
        Some(&pair.optimizer),
    )
    .map_err(|(detail, hint)| mismatch(format!("{name}: {detail}"), hint))?;
    restore_scheduler(&dir.join(name), scheduler, pair.scheduler, state.updates)
        .map_err(|(detail, hint)| mismatch(format!("{name}: {detail}"), hint))?;
    optimizer
        .slot()
        .lock()
        .windows
        .restore(state.clone(), ctx.device);
    Ok(model)
}

/// What every load reads first.
struct Saved {
    manifest: Manifest,
    /// The main process's `training_state.json`.
    training: TrainingState,
    /// This rank's loop state (rank 0's when the world size changed).
    saved: RankState,
    /// Whether the checkpoint was saved by as many processes as this job has.
    same_world: bool,
}

fn read_saved(ctx: &Context<'_>, dir: &Path) -> Result<Saved, AccelerateError> {
    let rank = ctx.state.rank;
    let unreadable = |source: CheckpointError| AccelerateError::CheckpointUnreadable {
        rank,
        path: dir.to_path_buf(),
        source,
    };
    let manifest = checkpoint::read_manifest(dir).map_err(unreadable)?;
    let same_world = manifest.world_size == ctx.state.world_size;
    let training = checkpoint::read_json(&dir.join(TRAINING_STATE_FILE)).map_err(unreadable)?;
    let own = rank_file(if same_world { rank } else { 0 });
    let saved = checkpoint::read_json(&dir.join(&own)).map_err(unreadable)?;
    Ok(Saved {
        manifest,
        training,
        saved,
        same_world,
    })
}

/// The stream states to continue from: this process's own (`own`, already read) when the
/// world size is the same, else every saving process's, in rank order (`own` is then rank
/// 0's, which `read_saved` read; the others' files are read here).
fn saved_streams(
    dir: &Path,
    manifest: &Manifest,
    own: Option<StreamState>,
    same_world: bool,
    rank: usize,
) -> Result<Vec<StreamState>, AccelerateError> {
    if same_world {
        return Ok(own.into_iter().collect());
    }
    (0..manifest.world_size)
        .map(|saver| {
            let path = dir.join(rank_file(saver));
            let stream = if saver == 0 {
                own.clone()
            } else {
                let state: RankState = checkpoint::read_json(&path).map_err(|source| {
                    AccelerateError::CheckpointUnreadable {
                        rank,
                        path: dir.to_path_buf(),
                        source,
                    }
                })?;
                state.stream
            };
            stream.ok_or_else(|| AccelerateError::ResumeMismatch {
                rank,
                path: path.clone(),
                detail: format!("rank {saver} saved no stream position"),
                hint: "resume from a checkpoint of a job that trained from a stream loader",
            })
        })
        .collect()
}

/// The error for a checkpoint in `dir` that does not fit what this run prepared.
fn mismatch(rank: usize, dir: &Path) -> impl Fn(String, &'static str) -> AccelerateError + '_ {
    move |detail, hint| AccelerateError::ResumeMismatch {
        rank,
        path: dir.to_path_buf(),
        detail,
        hint,
    }
}

/// Continues `scheduler` from the record in `dir` (`saved`: whether the checkpoint has one),
/// taken after `updates` updates; on failure, what does not fit and a hint.
fn restore_scheduler(
    dir: &Path,
    scheduler: Option<&mut PreparedScheduler>,
    saved: bool,
    updates: u64,
) -> Result<(), (String, &'static str)> {
    match (scheduler, saved) {
        (Some(scheduler), true) => {
            let record = LrSchedulerRecord::load(dir.join(SCHEDULER_FILE)).map_err(|e| {
                (
                    format!("{SCHEDULER_FILE}: {e}"),
                    "resume with the scheduler the checkpoint was saved with",
                )
            })?;
            scheduler.restore(record, updates);
            Ok(())
        }
        (Some(_), false) => Err((
            "a scheduler was given but the checkpoint has none".into(),
            "pass None, or save with Checkpoint::scheduler (Checkpoint::pair_with_scheduler)",
        )),
        (None, _) => Ok(()),
    }
}
