//! One epoch of a prepared stream loader: before each batch the processes say what they hold
//! ready and agree how many batches the epoch still has; a process whose data ran out pads
//! (with even batches) from the epoch's first shards.

use std::collections::VecDeque;
use std::sync::Arc;

use accelerate_core::stream_order::{Agreed, agree, shard_order};
use accelerate_core::stream_walk::remaining_streams;
use accelerate_core::{Ahead, BatchPosition, StreamCursor, StreamState};

use super::PreparedStreamLoader;
use super::reader::{Built, FromReader, ReadPlan, Reader};
use crate::data::LoaderRole;
use crate::error::AccelerateError;
use crate::loader_link::BatchPadding;

impl<I: Send + 'static, O: Send + 'static> PreparedStreamLoader<I, O> {
    /// Iterates over the batches of the current epoch, built on the accelerator's device and
    /// read ahead on a background thread; a training loader resumed from a checkpoint
    /// continues where the saved run stood.
    pub fn iter(&self) -> StreamBatchIter<'_, I, O> {
        let epoch = self.epoch();
        let (world, rank) = (self.comm.world_size(), self.comm.rank());
        let resumed = match self.role {
            LoaderRole::Train => self.links.take_stream_resume(epoch),
            LoaderRole::Eval => None,
        };
        let state = resumed.unwrap_or_else(|| {
            StreamState::epoch_start(self.loader.config.clone(), epoch, (world, rank))
        });
        self.set_position(&state);
        let plan = ReadPlan {
            source: Arc::clone(&self.loader.source),
            batcher: Arc::clone(&self.loader.batcher),
            device: self.device.clone(),
            config: self.loader.config.clone(),
            epoch,
            streams: state.streams.clone(),
        };
        StreamBatchIter {
            _evaluation: matches!(self.role, LoaderRole::Eval).then(crate::phases::evaluation),
            reader: Reader::start(plan, self.loader.prefetch),
            walked: state.streams.clone(),
            state,
            ready: VecDeque::new(),
            ended: false,
            failed: None,
            done: false,
            prepared: self,
        }
    }
}

impl<'a, I: Send + 'static, O: Send + 'static> IntoIterator for &'a PreparedStreamLoader<I, O> {
    type Item = Result<O, AccelerateError>;
    type IntoIter = StreamBatchIter<'a, I, O>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// The batches of one epoch of a [`PreparedStreamLoader`].
pub struct StreamBatchIter<'a, I, O> {
    prepared: &'a PreparedStreamLoader<I, O>,
    reader: Reader<I, O>,
    /// The streams the reader walks (its positions count in this list).
    walked: Vec<StreamCursor>,
    /// Where this process stands.
    state: StreamState,
    /// Batches read and not yet handed out.
    ready: VecDeque<(Built<I, O>, accelerate_core::Walked)>,
    ended: bool,
    failed: Option<String>,
    done: bool,
    _evaluation: Option<tracing::Span>,
}

impl<I: Send + 'static, O: Send + 'static> StreamBatchIter<'_, I, O> {
    fn rank(&self) -> usize {
        self.prepared.comm.rank()
    }

    fn error(&self, detail: String) -> AccelerateError {
        AccelerateError::Stream {
            rank: self.rank(),
            detail: format!(
                "epoch {}, batch {}: {detail}",
                self.state.epoch, self.state.batches
            ),
        }
    }

    /// Reads until `lookahead` batches are ready or the streams ended.
    fn fill(&mut self) {
        while !self.ended && self.failed.is_none() && self.ready.len() < self.prepared.lookahead {
            match self.reader.recv() {
                FromReader::Batch(built, walked) => {
                    // No batch follows a short one.
                    self.ended |= matches!(built, Built::Short(_));
                    self.ready.push_back((built, walked));
                }
                FromReader::End => self.ended = true,
                FromReader::Failed(why) => self.failed = Some(why),
            }
        }
    }

    /// What every process holds, in rank order.
    fn agree(&mut self) -> Result<Agreed, AccelerateError> {
        let mine = Ahead {
            ready: self.ready.len(),
            full: self
                .ready
                .iter()
                .filter(|(b, _)| matches!(b, Built::Full(_)))
                .count(),
            ended: self.ended,
            failed: self.failed.is_some(),
        };
        let comm = &self.prepared.comm;
        let all = if comm.world_size() > 1 {
            comm.lock().all_gather_object(&mine)?
        } else {
            vec![mine]
        };
        if let Some((rank, _)) = all.iter().enumerate().find(|(_, a)| a.failed) {
            let detail = match (&self.failed, rank == self.rank()) {
                (Some(why), true) => why.clone(),
                _ => format!("rank {rank}'s stream failed (its error says why); stopping too"),
            };
            return Err(self.error(detail));
        }
        Ok(agree(&self.state.config, self.prepared.lookahead, &all))
    }

    /// `count` padding items: the epoch's shards in their order from the start, wrapping.
    fn padding(&mut self, count: usize) -> Result<Vec<I>, AccelerateError> {
        let source = Arc::clone(&self.prepared.loader.source);
        let order = shard_order(&self.state.config, self.state.epoch);
        let mut items = Vec::with_capacity(count);
        let mut empty_in_a_row = 0;
        while items.len() < count {
            let at = self.state.padding;
            let Some(&shard) = order.get(at.shard) else {
                return Err(self.error("no shards to pad from".into()));
            };
            let reader = source
                .read(shard, at.item)
                .map_err(|e| self.error(format!("padding from shard {shard}: {e}")))?;
            let before = items.len();
            for item in reader.take(count - items.len()) {
                items.push(
                    item.map_err(|e| self.error(format!("padding from shard {shard}: {e}")))?,
                );
            }
            let read = items.len() - before;
            self.state.padding.item += read as u64;
            if items.len() < count {
                // The shard is done: the next one, wrapping to the first.
                self.state.padding.shard = (at.shard + 1) % order.len();
                self.state.padding.item = 0;
                empty_in_a_row = if read == 0 { empty_in_a_row + 1 } else { 0 };
                if empty_in_a_row > order.len() {
                    return Err(self.error("every shard is empty: nothing to pad with".into()));
                }
            }
        }
        Ok(items)
    }

    /// Hands out the next batch of this process (padding as agreed).
    fn hand_out(&mut self) -> Result<(O, usize), AccelerateError> {
        let config = &self.state.config;
        // With several processes, even batches are full batches (one process has nobody to
        // even out with, and keeps its short last batch).
        let several = self.prepared.comm.world_size() > 1;
        let pad = several && config.even_batches && !config.drop_last;
        let batch_size = config.batch_size;
        let batcher = Arc::clone(&self.prepared.loader.batcher);
        let device = &self.prepared.device;
        match self.ready.pop_front() {
            Some((built, walked)) => {
                self.state.streams = remaining_streams(&self.walked, walked);
                match built {
                    Built::Full(batch) => Ok((batch, 0)),
                    Built::Short(mut items) => {
                        let padding = if pad {
                            batch_size - items.len().min(batch_size)
                        } else {
                            0
                        };
                        items.extend(self.padding(padding)?);
                        Ok((batcher.batch(items, device), padding))
                    }
                }
            }
            // This process ran out before the others: a batch of padding.
            None => Ok((batcher.batch(self.padding(batch_size)?, device), batch_size)),
        }
    }

    fn next_batch(&mut self) -> Result<Option<O>, AccelerateError> {
        self.fill();
        let agreed = self.agree()?;
        let prepared = self.prepared;
        if agreed.remaining == 0 {
            if !self.ready.is_empty() || !self.ended {
                tracing::debug!(
                    rank = self.rank(),
                    "another process's stream ran out first: the rest of this one is not read \
                     this epoch (even_batches is off)"
                );
            }
            let next = StreamState::epoch_start(
                self.state.config.clone(),
                self.state.epoch + 1,
                (prepared.comm.world_size(), prepared.comm.rank()),
            );
            prepared.set_position(&next);
            prepared.links.set_batch_padding(None);
            return Ok(None);
        }
        let index = self.state.batches;
        let epoch_len = index
            + if agreed.exact {
                agreed.remaining
            } else {
                prepared.lookahead
            };
        let (batch, padding) = self.hand_out()?;
        self.state.batches += 1;
        prepared.set_position(&self.state);
        if let LoaderRole::Train = prepared.role {
            prepared
                .clock
                .begin_batch(BatchPosition { index, epoch_len });
        }
        prepared
            .links
            .set_batch_padding(Some(BatchPadding::Own(padding)));
        Ok(Some(batch))
    }
}

impl<I: Send + 'static, O: Send + 'static> Iterator for StreamBatchIter<'_, I, O> {
    type Item = Result<O, AccelerateError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let training = matches!(self.prepared.role, LoaderRole::Train);
        let wait = crate::phases::data_wait(if training { "train" } else { "eval" });
        let next = self.next_batch();
        drop(wait);
        self.done = !matches!(next, Ok(Some(_)));
        if training && !self.done {
            crate::phases::batch_ready();
        }
        next.transpose()
    }
}
