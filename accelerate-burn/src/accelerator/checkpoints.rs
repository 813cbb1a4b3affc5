//! Saving and resuming: the accelerator's side of [`crate::checkpoint`], and automatically
//! named, rotated checkpoints under the project directory.

use std::path::{Path, PathBuf};

use accelerate_core::checkpoint::CheckpointRotation;
use burn::module::Module;

use super::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::checkpoint::save::SaveMode;
use crate::checkpoint::{self, Checkpoint, CheckpointInfo, Context, Restored};
use crate::error::AccelerateError;
use crate::optim::{PreparedOptimizer, PreparedScheduler};

impl<B: AcceleratorBackend> Accelerator<B> {
    fn checkpoint_context(&self) -> Context<'_> {
        Context {
            state: &self.state,
            comm: &self.comm,
            slots: &self.slots,
            links: &self.links,
            device: &self.device,
            seed: self.config.seed,
            resume_any_world_size: self.checkpoints.resume_any_world_size,
            shards: &self.shards,
        }
    }

    /// Saves the whole training state into `dir` (every process must call it, at the same
    /// point: after an optimizer update). Returns `dir`.
    ///
    /// The model, scheduler and user objects come from the main process (data parallelism
    /// keeps them identical), the optimizer state as its reducer keeps it (every shard with
    /// ZeRO); each process adds its own loop state. Nothing appears at `dir` until every
    /// process has written its part; an existing checkpoint at `dir` is replaced only then, in
    /// one atomic swap where the file system has it. A `dir` that holds anything but an
    /// accelerate-rs checkpoint (a user's logs, an exported model) is never replaced: the save
    /// fails with an error naming it, and nothing there is touched (Hugging Face Accelerate
    /// writes into the directory; we refuse rather than mix or delete files).
    /// Saving in the middle of an accumulation window is an error (its partial gradient sum is
    /// not saved).
    ///
    /// With [`async_checkpoints`](crate::AcceleratorBuilder::async_checkpoints) the call
    /// returns once the snapshot is taken; the checkpoint appears at `dir` when the
    /// background write is committed (see [`wait_for_checkpoint`](Self::wait_for_checkpoint)).
    pub fn save_state<M: Module>(
        &self,
        dir: impl AsRef<Path>,
        checkpoint: &Checkpoint<'_, M>,
    ) -> Result<PathBuf, AccelerateError> {
        self.save_into(dir.as_ref(), checkpoint, None)?;
        Ok(dir.as_ref().to_path_buf())
    }

    /// Saves `checkpoint` into `dir`, after the save in flight; `rotation` (automatically
    /// named checkpoints) is applied after the commit of a background save. Returns whether
    /// the save went to the background.
    fn save_into<M: Module>(
        &self,
        dir: &Path,
        checkpoint: &Checkpoint<'_, M>,
        rotation: Option<CheckpointRotation>,
    ) -> Result<bool, AccelerateError> {
        let _phase = crate::phases::checkpoint("save");
        self.wait_for_checkpoint()?;
        let mode = match self.config.async_checkpoints {
            true => SaveMode::Background {
                snapshot: self.checkpoints.snapshot,
                rotation,
            },
            false => SaveMode::Now,
        };
        let save = checkpoint::save::save_state(&self.checkpoint_context(), dir, checkpoint, mode)?;
        let background = save.is_some();
        *self.lock_background_save() = save;
        Ok(background)
    }

    /// Waits for the checkpoint being saved in the background, if any, and reports how it
    /// went: an error names the ranks whose part failed and why. Every process must call it
    /// at the same point (the next save or load calls it too). Does nothing without
    /// [`async_checkpoints`](crate::AcceleratorBuilder::async_checkpoints).
    pub fn wait_for_checkpoint(&self) -> Result<(), AccelerateError> {
        let in_flight = self.lock_background_save().take();
        match in_flight {
            Some(save) => save.finish(&self.checkpoint_context()),
            None => Ok(()),
        }
    }

    fn lock_background_save(
        &self,
    ) -> std::sync::MutexGuard<'_, Option<crate::checkpoint::BackgroundSave>> {
        self.background_save
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
        let _phase = crate::phases::checkpoint("load");
        self.wait_for_checkpoint()?;
        checkpoint::load::load_state(
            &self.checkpoint_context(),
            dir.as_ref(),
            model,
            optimizer,
            scheduler,
        )
    }

    /// Restores the model and optimizer saved under `name` with
    /// [`Checkpoint::pair`](crate::Checkpoint::pair) in the checkpoint `info` describes (what
    /// [`load_state`](Self::load_state) or [`load_latest_checkpoint`](Self::load_latest_checkpoint)
    /// returned): returns `model` with its saved weights, and loads `optimizer`, its loop
    /// counters and `scheduler` (saved with
    /// [`pair_with_scheduler`](crate::Checkpoint::pair_with_scheduler)). On a fresh start (no
    /// checkpoint was loaded) returns `model` as it is. Every process must call it.
    ///
    /// ```text
    /// let restored = acc.load_latest_checkpoint(generator, &mut g_optim, None)?;
    /// let generator = restored.model;
    /// let critic = acc.load_pair(&restored.info, "critic", critic, &mut c_optim, None)?;
    /// ```
    pub fn load_pair<M: Module>(
        &self,
        info: &CheckpointInfo,
        name: &str,
        model: M,
        optimizer: &mut PreparedOptimizer,
        scheduler: Option<&mut PreparedScheduler>,
    ) -> Result<M, AccelerateError> {
        self.wait_for_checkpoint()?;
        match &info.path {
            Some(dir) => checkpoint::load::load_pair(
                &self.checkpoint_context(),
                dir,
                name,
                (model, optimizer, scheduler),
            ),
            None => Ok(model),
        }
    }

    /// The project's automatically named checkpoints (needs
    /// [`project_dir`](crate::AcceleratorBuilder::project_dir)).
    fn rotation(&self) -> Result<CheckpointRotation, AccelerateError> {
        match &self.checkpoints.project_dir {
            Some(dir) => Ok(CheckpointRotation::new(dir, self.checkpoints.total_limit)),
            None => Err(AccelerateError::Misuse {
                rank: self.state.rank,
                what: "no project directory for automatically named checkpoints".into(),
                hint: "build the accelerator with .project_dir(path), or call save_state with \
                       a directory",
            }),
        }
    }

    /// Saves into `<project_dir>/checkpoints/checkpoint_<updates>` and then removes the
    /// checkpoints committed longest ago beyond the total limit (never the new one: after a
    /// resume from an older checkpoint, the abandoned run's go first). Returns the new
    /// checkpoint's directory.
    pub fn save_checkpoint<M: Module>(
        &self,
        checkpoint: &Checkpoint<'_, M>,
    ) -> Result<PathBuf, AccelerateError> {
        let rotation = self.rotation()?;
        let dir = rotation.path_for(checkpoint.optimizer_updates());
        if self.save_into(&dir, checkpoint, Some(rotation.clone()))? {
            // Rotated by the main process after the background commit.
            return Ok(dir);
        }
        let rotated = match self.is_main_process() {
            true => rotation.rotate(&dir).map(|removed| {
                for path in removed {
                    tracing::info!(path = %path.display(), "old checkpoint removed");
                }
            }),
            false => Ok(()),
        };
        // Every rank returns the main process's outcome, so none trains on believing a
        // rotation went well that failed.
        self.checkpoint_context()
            .agree(&rotation.root, "removing old checkpoints", rotated)?;
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
        self.wait_for_checkpoint()?;
        let rotation = self.rotation()?;
        // The main process decides, so that every process loads the same one.
        let latest = rotation.latest();
        let latest: Option<PathBuf> = if self.state.is_distributed() {
            self.comm.lock().broadcast_object(Some(&latest), 0)?
        } else {
            latest
        };
        match latest {
            Some(dir) => self.load_state(dir, model, optimizer, scheduler),
            None => Ok(Restored {
                model,
                info: CheckpointInfo::fresh(self.state.rank),
            }),
        }
    }
}

impl<B: AcceleratorBackend> Drop for Accelerator<B> {
    /// Lets a checkpoint still being saved in the background finish (no collective: what
    /// fails is logged; call [`wait_for_checkpoint`](Accelerator::wait_for_checkpoint) to see
    /// it as an error), and ends the run on the trackers.
    fn drop(&mut self) {
        if let Some(save) = self.lock_background_save().take() {
            let peers_failed = self.comm.is_distributed() && self.comm.lock().has_failed();
            save.finish_at_exit(peers_failed);
        }
        self.finish_trackers_at_exit();
        if let Some(Err(err)) = accelerate_core::trace::write_installed() {
            tracing::warn!(
                rank = self.state.rank,
                "the trace could not be written: {err}"
            );
        }
    }
}
