//! Decoded row groups, the most recently used kept. Each entry has its own lock, so threads
//! asking for the same row group wait for one decode instead of decoding it twice, and threads
//! asking for different ones decode side by side.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use arrow_array::RecordBatch;

use crate::DataError;

type Slot = Arc<Mutex<Option<RecordBatch>>>;

/// Up to `capacity` decoded row groups, by piece index, least recently used first.
#[derive(Debug)]
pub(super) struct RowGroupCache {
    slots: Mutex<VecDeque<(usize, Slot)>>,
    capacity: usize,
}

impl RowGroupCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            slots: Mutex::new(VecDeque::with_capacity(capacity + 1)),
            capacity: capacity.max(1),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Row group `piece`, decoded by `decode` unless it is cached (a failed decode is not
    /// cached: the next request tries again).
    pub fn get(
        &self,
        piece: usize,
        decode: impl FnOnce() -> Result<RecordBatch, DataError>,
    ) -> Result<RecordBatch, DataError> {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
            let slot = match slots.iter().position(|(p, _)| *p == piece) {
                Some(at) => slots.remove(at).map(|(_, slot)| slot),
                None => None,
            }
            .unwrap_or_default();
            slots.push_back((piece, Arc::clone(&slot)));
            while slots.len() > self.capacity {
                slots.pop_front();
            }
            slot
        };
        let mut decoded = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(batch) = decoded.as_ref() {
            return Ok(batch.clone());
        }
        let batch = decode()?;
        *decoded = Some(batch.clone());
        Ok(batch)
    }
}
