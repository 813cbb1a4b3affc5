//! The Learner's checkpoints, written so that a process killed at any moment leaves whole
//! files: each record goes to a temporary file beside its name, synced, then renamed into
//! place (burn-train's `FileCheckpointer` writes in place, so a kill during a save leaves a
//! truncated file under the checkpoint's name). [`latest_learner_checkpoint`] finds the last
//! epoch whose model, optimizer and scheduler were all saved.

use std::path::{Path, PathBuf};

use accelerate_core::checkpoint::replace_file;
use burn::train::checkpoint::{Checkpoint, Checkpointer, CheckpointerError};

/// Records of the Learner, under the names burn-train gives them.
const RECORDS: [&str; 3] = ["model", "optim", "scheduler"];

/// A burn-train checkpointer whose saves are atomic: `<directory>/<name>-<epoch>.bpk`, as
/// burn-train's own `FileCheckpointer` names them, written through a temporary file, synced
/// and renamed. Give three of them to `SupervisedTraining::with_custom_checkpointers` (see
/// [`durable_checkpointers`]).
#[derive(Debug, Clone)]
pub struct DurableCheckpointer {
    directory: PathBuf,
    name: String,
}

impl DurableCheckpointer {
    /// A checkpointer of the records called `name` in `directory`.
    pub fn new(directory: impl AsRef<Path>, name: &str) -> Self {
        Self {
            directory: directory.as_ref().to_path_buf(),
            name: name.to_string(),
        }
    }

    fn path(&self, epoch: usize) -> PathBuf {
        self.directory.join(format!("{}-{epoch}.bpk", self.name))
    }
}

/// The model, optimizer and scheduler checkpointers of a Learner writing to `directory` (the
/// one given to `SupervisedTraining::new`), in its `checkpoint` folder as burn-train lays it
/// out:
///
/// ```text
/// let (model, optim, scheduler) = durable_checkpointers(&dir);
/// let training = SupervisedTraining::new(&dir, train, valid)
///     .with_custom_checkpointers(model, optim, scheduler);
/// let training = match latest_learner_checkpoint(&dir) {
///     Some(epoch) => training.checkpoint(epoch),
///     None => training,
/// };
/// ```
pub fn durable_checkpointers(
    directory: impl AsRef<Path>,
) -> (
    DurableCheckpointer,
    DurableCheckpointer,
    DurableCheckpointer,
) {
    let folder = directory.as_ref().join("checkpoint");
    let [model, optim, scheduler] = RECORDS.map(|name| DurableCheckpointer::new(&folder, name));
    (model, optim, scheduler)
}

/// The last epoch whose model, optimizer and scheduler records are all in `directory`'s
/// `checkpoint` folder (the Learner saves the three separately, so a run stopped during a save
/// may have some of an epoch's records), or `None`.
pub fn latest_learner_checkpoint(directory: impl AsRef<Path>) -> Option<usize> {
    let folder = directory.as_ref().join("checkpoint");
    let entries = std::fs::read_dir(&folder).ok()?;
    entries
        .filter_map(|entry| {
            let name = entry.ok()?.file_name();
            let epoch = name
                .to_str()?
                .strip_prefix("model-")?
                .strip_suffix(".bpk")?;
            epoch.parse::<usize>().ok()
        })
        .filter(|epoch| {
            RECORDS
                .iter()
                .all(|record| folder.join(format!("{record}-{epoch}.bpk")).is_file())
        })
        .max()
}

impl<R: Checkpoint> Checkpointer<R> for DurableCheckpointer {
    fn save(&self, epoch: usize, record: R) -> Result<(), CheckpointerError> {
        std::fs::create_dir_all(&self.directory).map_err(CheckpointerError::IOError)?;
        replace_file(&self.path(epoch), |temporary| {
            record.save(temporary.to_path_buf())
        })
        .map(|_| ())
        .map_err(|error| CheckpointerError::Unknown(error.to_string()))
    }

    fn restore(&self, epoch: usize) -> Result<R, CheckpointerError> {
        R::load(self.path(epoch))
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        let path = self.path(epoch);
        match std::fs::remove_file(&path) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                Err(CheckpointerError::IOError(error))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_checkpoint_is_the_last_epoch_with_all_three_records() {
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(latest_learner_checkpoint(tmp.path()), None);
        let folder = tmp.path().join("checkpoint");
        std::fs::create_dir_all(&folder).unwrap();
        for epoch in [1, 2] {
            for record in RECORDS {
                std::fs::write(folder.join(format!("{record}-{epoch}.bpk")), b"x").unwrap();
            }
        }
        // Epoch 3: the model was saved, the optimizer and scheduler not yet.
        std::fs::write(folder.join("model-3.bpk"), b"x").unwrap();
        std::fs::write(folder.join(".model-4.bpk.123.0.tmp"), b"x").unwrap();
        assert_eq!(latest_learner_checkpoint(tmp.path()), Some(2));
    }

    /// A record's name that is a link to a file of the user's: the save replaces the link and
    /// the rotation removes it; the user's file is never written nor removed.
    #[cfg(unix)]
    #[test]
    fn a_link_at_a_records_name_never_leads_a_save_or_a_deletion_to_the_users_file() {
        let tmp = tempfile::tempdir().unwrap();
        let theirs = tmp.path().join("notes.txt");
        std::fs::write(&theirs, b"mine").unwrap();
        let folder = tmp.path().join("checkpoint");
        std::fs::create_dir_all(&folder).unwrap();
        std::os::unix::fs::symlink(&theirs, folder.join("scheduler-1.bpk")).unwrap();
        let (_, _, scheduler) = durable_checkpointers(tmp.path());
        let record = burn::lr_scheduler::LrSchedulerRecord::default();
        Checkpointer::<burn::lr_scheduler::LrSchedulerRecord>::save(&scheduler, 1, record).unwrap();
        assert_eq!(std::fs::read(&theirs).unwrap(), b"mine");
        assert!(!folder.join("scheduler-1.bpk").is_symlink());
        std::os::unix::fs::symlink(&theirs, folder.join("scheduler-2.bpk")).unwrap();
        Checkpointer::<burn::lr_scheduler::LrSchedulerRecord>::delete(&scheduler, 2).unwrap();
        assert_eq!(std::fs::read(&theirs).unwrap(), b"mine");
    }

    #[test]
    fn a_save_is_whole_and_leaves_no_temporary_file() {
        let tmp = tempfile::tempdir().unwrap();
        let (_, _, scheduler) = durable_checkpointers(tmp.path());
        let record = burn::lr_scheduler::LrSchedulerRecord::default();
        Checkpointer::<burn::lr_scheduler::LrSchedulerRecord>::save(&scheduler, 1, record).unwrap();
        let files: Vec<String> = std::fs::read_dir(tmp.path().join("checkpoint"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(files, ["scheduler-1.bpk"]);
        let _: burn::lr_scheduler::LrSchedulerRecord =
            Checkpointer::restore(&scheduler, 1).unwrap();
    }
}
