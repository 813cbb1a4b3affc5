//! The thread that reads a process's streams ahead of the loop: walks them item by item
//! ([`StreamWalk`]), cuts batches, builds the full ones with the batcher, and sends each with
//! where the streams stand after it. A short batch (the last) is sent as items, since the
//! loop may pad it.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender};
use std::thread::JoinHandle;

use accelerate_core::{StreamConfig, StreamCursor, StreamWalk, Walked};
use burn::data::dataloader::batcher::Batcher;
use burn::tensor::Device;

use super::sources::StreamSource;

/// A batch the reader made.
pub(super) enum Built<I, O> {
    /// A full batch, built.
    Full(O),
    /// The streams' last items, fewer than a batch.
    Short(Vec<I>),
}

/// What the reader sends.
pub(super) enum FromReader<I, O> {
    /// The next batch, and where the streams stand after it.
    Batch(Built<I, O>, Walked),
    /// Every stream is read.
    End,
    /// Reading failed.
    Failed(String),
}

/// The reader of one epoch's streams; stops when dropped.
pub(super) struct Reader<I, O> {
    batches: Receiver<FromReader<I, O>>,
    thread: Option<JoinHandle<()>>,
}

/// What a reader reads and how it builds batches.
pub(super) struct ReadPlan<I, O> {
    pub source: Arc<dyn StreamSource<I>>,
    pub batcher: Arc<dyn Batcher<I, O>>,
    pub device: Device,
    pub config: StreamConfig,
    pub epoch: u64,
    pub streams: Vec<StreamCursor>,
}

impl<I: Send + 'static, O: Send + 'static> Reader<I, O> {
    /// Starts reading `plan`, up to `ahead` batches ahead of the loop.
    pub fn start(plan: ReadPlan<I, O>, ahead: usize) -> Self {
        let (send, batches) = std::sync::mpsc::sync_channel(ahead.max(1));
        let thread = std::thread::Builder::new()
            .name("accelerate-stream".into())
            .spawn(move || read(plan, &send));
        let thread = match thread {
            Ok(thread) => Some(thread),
            Err(e) => {
                let (send, failed) = std::sync::mpsc::sync_channel(1);
                let _ = send.send(FromReader::Failed(format!(
                    "the stream's reader thread could not be started: {e}"
                )));
                return Self {
                    batches: failed,
                    thread: None,
                };
            }
        };
        Self { batches, thread }
    }
}

impl<I, O> Reader<I, O> {
    /// The next message; a panic on the reader's thread (in the source or the batcher) is
    /// raised here, in the training loop, as if it had happened there.
    pub fn recv(&mut self) -> FromReader<I, O> {
        match self.batches.recv() {
            Ok(message) => message,
            Err(_) => {
                if let Some(Err(panic)) = self.thread.take().map(JoinHandle::join) {
                    std::panic::resume_unwind(panic);
                }
                FromReader::Failed("the stream's reader thread stopped early".into())
            }
        }
    }
}

fn read<I, O>(plan: ReadPlan<I, O>, send: &SyncSender<FromReader<I, O>>) {
    let ReadPlan {
        source,
        batcher,
        device,
        config,
        epoch,
        streams,
    } = plan;
    let batch_size = config.batch_size.max(1);
    let source = source.as_ref();
    let walk = StreamWalk::new((config, epoch), streams, |shard, skip| {
        source.read(shard, skip)
    });
    let mut items = Vec::with_capacity(batch_size);
    let mut last = None;
    for step in walk {
        match step {
            Ok((item, walked)) => {
                items.push(item);
                last = Some(walked);
                if items.len() == batch_size {
                    let full = batcher.batch(std::mem::take(&mut items), &device);
                    // The loop stopped early (the iterator was dropped): stop too.
                    if send
                        .send(FromReader::Batch(Built::Full(full), walked))
                        .is_err()
                    {
                        return;
                    }
                }
            }
            Err(failed) => {
                let _ = send.send(FromReader::Failed(format!(
                    "reading shard {}: {}",
                    failed.shard, failed.source
                )));
                return;
            }
        }
    }
    if let (false, Some(walked)) = (items.is_empty(), last)
        && send
            .send(FromReader::Batch(Built::Short(items), walked))
            .is_err()
    {
        return;
    }
    let _ = send.send(FromReader::End);
}

impl<I, O> Drop for Reader<I, O> {
    fn drop(&mut self) {
        // Closing the channel first lets a thread blocked on a full channel finish.
        let (_, closed) = std::sync::mpsc::sync_channel(0);
        drop(std::mem::replace(&mut self.batches, closed));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
