//! The job's groups warn each other: when a group of this process fails (a peer of its own
//! is gone, or disagreed), the peers of every other group of the job that this process
//! belongs to read why on their own transport. Without it, a rank waiting for this one in
//! another group sees only this process exit, and names it instead of the cause.

use std::sync::{Arc, Mutex, PoisonError};

use crate::comm::engine::AbortNotice;

/// The notices of a job's groups in this process: the job's group and those split from it.
#[derive(Default)]
pub(super) struct JobAlarm {
    /// Each live group's notice, by the group's tag.
    notices: Mutex<Vec<(u64, Arc<dyn AbortNotice>)>>,
}

impl JobAlarm {
    /// Adds group `tag`'s notice (a group whose transport has none is told nothing).
    pub(super) fn join(&self, tag: u64, notice: Option<Arc<dyn AbortNotice>>) {
        if let Some(notice) = notice {
            self.lock().push((tag, notice));
        }
    }

    /// Removes group `tag`'s notice (the group is dropped).
    pub(super) fn leave(&self, tag: u64) {
        self.lock().retain(|(t, _)| *t != tag);
    }

    /// Tells the peers of every group but `from` (which told its own) that this rank failed.
    pub(super) fn raise(&self, from: u64, reason: &str) {
        let notices: Vec<_> = self
            .lock()
            .iter()
            .filter(|(tag, _)| *tag != from)
            .map(|(_, notice)| Arc::clone(notice))
            .collect();
        for notice in notices {
            notice.tell(reason);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(u64, Arc<dyn AbortNotice>)>> {
        // A thread that panicked while holding it left the list whole (pushes and retains).
        self.notices.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
