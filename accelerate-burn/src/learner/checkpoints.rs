//! The Learner's checkpoints, written so that a process killed at any moment leaves whole
//! files: each record goes to a temporary file beside its name, synced, then renamed into
//! place (burn-train's `FileCheckpointer` writes in place, so a kill during a save leaves a
//! truncated file under the checkpoint's name). Each checkpointer lists the epochs it wrote in
//! a manifest beside its records (`.<name>.records.json`), and replaces or removes only those:
//! a file at a record's name that a previous version, another program or the user left stops
//! the save and survives rotation. [`latest_learner_checkpoint`] finds the last epoch whose
//! model, optimizer and scheduler were all saved.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use accelerate_core::checkpoint::{read_json, replace_file, write_json};
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

    /// The manifest of the epochs this checkpointer's records were written for.
    fn manifest(&self) -> PathBuf {
        self.directory.join(format!(".{}.records.json", self.name))
    }

    /// The epochs whose records are ours (none when the manifest is absent or unreadable: then
    /// nothing is replaced or removed).
    fn ours(&self) -> BTreeSet<usize> {
        read_json(&self.manifest()).unwrap_or_default()
    }

    fn write_manifest(&self, epochs: &BTreeSet<usize>) -> Result<(), CheckpointerError> {
        replace_file(&self.manifest(), |temporary| {
            write_json(temporary, epochs).map(drop)
        })
        .map(drop)
        .map_err(|error| CheckpointerError::Unknown(error.to_string()))
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
        let path = self.path(epoch);
        let mut ours = self.ours();
        if std::fs::symlink_metadata(&path).is_ok() && !ours.contains(&epoch) {
            return Err(CheckpointerError::Unknown(format!(
                "{} exists and accelerate-rs did not write it (it is not in {}): it is not \
                 replaced; move it away, or give the Learner another directory",
                path.display(),
                self.manifest().display()
            )));
        }
        // Listed before it is written: a kill in between leaves an entry without a file, never
        // a file of ours that a later run would take for someone else's.
        if ours.insert(epoch) {
            self.write_manifest(&ours)?;
        }
        replace_file(&path, |temporary| record.save(temporary.to_path_buf()))
            .map(|_| ())
            .map_err(|error| CheckpointerError::Unknown(error.to_string()))
    }

    fn restore(&self, epoch: usize) -> Result<R, CheckpointerError> {
        R::load(self.path(epoch))
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        let mut ours = self.ours();
        if !ours.contains(&epoch) {
            // Not ours to remove.
            return Ok(());
        }
        match std::fs::remove_file(self.path(epoch)) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(CheckpointerError::IOError(error));
            }
            _ => {}
        }
        ours.remove(&epoch);
        self.write_manifest(&ours)
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

    /// Files at a record's name that this checkpointer did not write (a regular file a
    /// previous run or the user left, a link to a file of the user's): the save stops with an
    /// error naming it and rotation leaves it; neither it nor what it links to is written or
    /// removed. The checkpointer's own records are replaced and rotated.
    #[cfg(unix)]
    #[test]
    fn files_at_a_records_name_that_are_not_ours_are_never_replaced_nor_removed() {
        type Record = burn::lr_scheduler::LrSchedulerRecord;
        let tmp = tempfile::tempdir().unwrap();
        let theirs = tmp.path().join("notes.txt");
        std::fs::write(&theirs, b"mine").unwrap();
        let folder = tmp.path().join("checkpoint");
        std::fs::create_dir_all(&folder).unwrap();
        std::os::unix::fs::symlink(&theirs, folder.join("scheduler-1.bpk")).unwrap();
        std::fs::write(folder.join("scheduler-2.bpk"), b"an older run's").unwrap();
        let (_, _, scheduler) = durable_checkpointers(tmp.path());
        for epoch in [1, 2] {
            let err = Checkpointer::<Record>::save(&scheduler, epoch, Record::default())
                .unwrap_err()
                .to_string();
            assert!(err.contains("did not write"), "{err}");
            Checkpointer::<Record>::delete(&scheduler, epoch).unwrap();
        }
        assert_eq!(std::fs::read(&theirs).unwrap(), b"mine");
        assert!(folder.join("scheduler-1.bpk").is_symlink());
        assert_eq!(
            std::fs::read(folder.join("scheduler-2.bpk")).unwrap(),
            b"an older run's"
        );
        // Its own: written, written again, rotated away.
        for _ in 0..2 {
            Checkpointer::<Record>::save(&scheduler, 3, Record::default()).unwrap();
        }
        Checkpointer::<Record>::delete(&scheduler, 3).unwrap();
        assert!(!folder.join("scheduler-3.bpk").exists());
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
        let mut files = files;
        files.sort();
        assert_eq!(files, [".scheduler.records.json", "scheduler-1.bpk"]);
        let _: burn::lr_scheduler::LrSchedulerRecord =
            Checkpointer::restore(&scheduler, 1).unwrap();
    }
}
