//! Groups split from a shared-memory group: each part of more than one rank gets a segment
//! of its own, created by its first rank and named after the group's, so that its collectives
//! never wait on ranks outside it.

use std::path::PathBuf;

use super::{ShmEngine, create_segment};
use crate::comm::call::CallDesc;
use crate::comm::engine::{all_agree, part_of};
use crate::error::CommError;

impl ShmEngine {
    /// The engine of this rank's part of `parts` (ranks of this group; `None` when the part
    /// is this rank alone). Every rank of the group calls it at once: each part's first rank
    /// creates its segment, all learn whether every creation worked (so nobody waits for a
    /// segment that will not come), then each part's ranks map theirs.
    pub(crate) fn split_part(
        &mut self,
        call: &CallDesc,
        parts: &[Vec<usize>],
    ) -> Result<Option<ShmEngine>, CommError> {
        let mine = part_of(parts, self.rank).to_vec();
        let path = PathBuf::from(format!(
            "{}-part-{}",
            self.base.display(),
            mine.first().copied().unwrap_or(self.rank)
        ));
        let slot_bytes = self.region.slot_bytes();
        let creator = mine.len() > 1 && mine.first() == Some(&self.rank);
        let created = if creator {
            // A file of that name is a leftover of an earlier job with the same secret.
            let _ = std::fs::remove_file(&path);
            create_segment(&path, mine.len(), slot_bytes, self.rank).map(|_| ())
        } else {
            Ok(())
        };
        if !all_agree(self, *call, created.is_ok())? {
            if creator {
                let _ = std::fs::remove_file(&path);
            }
            return Err(created.err().unwrap_or_else(|| CommError::Usage {
                op: "split",
                rank: self.rank,
                reason: "another rank of this host could not create its group's shared \
                         memory segment (its error says why)"
                    .into(),
            }));
        }
        if mine.len() <= 1 {
            return Ok(None);
        }
        let index = mine.iter().position(|&r| r == self.rank).unwrap_or(0);
        ShmEngine::open(&path, index, mine.len(), slot_bytes, self.timeout).map(Some)
    }
}
