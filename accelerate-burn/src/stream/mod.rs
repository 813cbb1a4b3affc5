//! Streaming data: a loader over data read shard by shard, of unknown length (a user's
//! iterators, Parquet row groups), for corpora whose items cannot be counted or addressed
//! ahead. The rules (shards dealt round-robin to processes, a shuffle buffer seeded from
//! `(seed, epoch, rank)`, batches agreed by a collective so that no process waits for a batch
//! that never comes, resume on the same or another number of processes) are
//! `accelerate_core::stream_order`'s; this module reads on a background thread, builds the
//! batches and keeps where the training loader stands for checkpoints.
//!
//! ```
//! use accelerate_burn::stream::{IterShards, StreamLoader};
//! use accelerate_burn::{Accelerator, DefaultBackend};
//! use accelerate_burn::burn::data::dataloader::batcher::Batcher;
//! use accelerate_burn::burn::tensor::{Device, Tensor, TensorData};
//!
//! #[derive(Clone)]
//! struct Numbers;
//! impl Batcher<f32, Tensor<1>> for Numbers {
//!     fn batch(&self, items: Vec<f32>, device: &Device) -> Tensor<1> {
//!         let n = items.len();
//!         Tensor::from_data(TensorData::new(items, [n]), device)
//!     }
//! }
//!
//! let acc = Accelerator::<DefaultBackend>::builder().build()?;
//! // Three shards of unknown length (a generator's partitions, a directory's files).
//! let source = IterShards::new(3, |shard| Ok::<_, std::io::Error>((0..10).map(move |i| (shard * 10 + i) as f32)));
//! let loader = acc.prepare(StreamLoader::builder(Numbers).batch_size(8).shuffle(7).shuffle_buffer(16).build(source))?;
//! let mut seen = 0;
//! for batch in loader.iter() {
//!     seen += batch?.dims()[0];
//! }
//! assert_eq!(seen, 30);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod batches;
mod reader;
pub mod sources;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use accelerate_core::stream_order::check_world;
use accelerate_core::{StreamConfig, StreamState};
use burn::data::dataloader::batcher::Batcher;
use burn::tensor::Device;

pub use batches::StreamBatchIter;
pub use sources::{DatasetShards, IterShards, SourceError, StreamSource};

use crate::data::{DEFAULT_PREFETCH, LoaderRole};
use crate::error::AccelerateError;
use crate::group::Comm;
use crate::loader_link::LoaderLinks;
use crate::training_loop::LoopClock;

/// Items shuffled together by default.
pub const DEFAULT_SHUFFLE_BUFFER: usize = 10_000;

/// A stream source, a Burn batcher and how to cut the stream into batches; give it to
/// [`Accelerator::prepare`](crate::Accelerator::prepare).
pub struct StreamLoader<I, O> {
    source: Arc<dyn StreamSource<I>>,
    batcher: Arc<dyn Batcher<I, O>>,
    config: StreamConfig,
    prefetch: usize,
}

/// Builds a [`StreamLoader`].
pub struct StreamLoaderBuilder<I, O> {
    batcher: Arc<dyn Batcher<I, O>>,
    config: StreamConfig,
    shuffle_buffer: Option<usize>,
    prefetch: usize,
}

impl<I, O> StreamLoader<I, O> {
    /// Starts a loader that turns items into batches with `batcher` (batch size 1, shards and
    /// items in order, even batches).
    pub fn builder(batcher: impl Batcher<I, O> + 'static) -> StreamLoaderBuilder<I, O> {
        StreamLoaderBuilder {
            batcher: Arc::new(batcher),
            config: StreamConfig {
                shards: 0,
                shuffle: false,
                seed: 0,
                shuffle_buffer: 1,
                batch_size: 1,
                even_batches: true,
                drop_last: false,
            },
            shuffle_buffer: None,
            prefetch: DEFAULT_PREFETCH,
        }
    }

    /// How the stream is cut.
    pub fn config(&self) -> &StreamConfig {
        &self.config
    }
}

impl<I, O> StreamLoaderBuilder<I, O> {
    /// Items per batch and process (at least 1).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.config.batch_size = batch_size.max(1);
        self
    }

    /// Shuffles each epoch with `(seed, epoch)`: the shards' order, and the items within
    /// blocks of [`shuffle_buffer`](Self::shuffle_buffer) items (default
    /// [`DEFAULT_SHUFFLE_BUFFER`]).
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.config.shuffle = true;
        self.config.seed = seed;
        self
    }

    /// Items shuffled together (held in memory while their block is handed out; at least 1).
    pub fn shuffle_buffer(mut self, items: usize) -> Self {
        self.shuffle_buffer = Some(items.max(1));
        self
    }

    /// With several processes holding unequal shares, `true` (the default) continues the
    /// epoch until every process ran out, the others padding their batches with items read
    /// again from the epoch's first shards; `false` ends it when the first process runs out
    /// (the others' remaining items are not read this epoch).
    pub fn even_batches(mut self, even_batches: bool) -> Self {
        self.config.even_batches = even_batches;
        self
    }

    /// Ends the epoch before the first short batch of any process.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.config.drop_last = drop_last;
        self
    }

    /// Batches read ahead of the loop on the reader thread (at least 1).
    pub fn prefetch(mut self, batches: usize) -> Self {
        self.prefetch = batches.max(1);
        self
    }

    /// Finishes the loader over `source`.
    pub fn build(mut self, source: impl StreamSource<I> + 'static) -> StreamLoader<I, O> {
        self.config.shards = source.shards();
        // Without shuffling, blocks keep the shards' order whatever their size: one item.
        self.config.shuffle_buffer = match self.config.shuffle {
            true => self.shuffle_buffer.unwrap_or(DEFAULT_SHUFFLE_BUFFER),
            false => 1,
        };
        StreamLoader {
            source: Arc::new(source),
            batcher: self.batcher,
            config: self.config,
            prefetch: self.prefetch,
        }
    }
}

/// A stream loader prepared by an [`Accelerator`](crate::Accelerator): yields batches built on
/// its device, epoch by epoch.
pub struct PreparedStreamLoader<I, O> {
    loader: StreamLoader<I, O>,
    device: Device,
    role: LoaderRole,
    clock: LoopClock,
    links: LoaderLinks,
    comm: Comm,
    /// Batches each process reads ahead before each batch is agreed: the accumulation steps
    /// and one (enough to know every window's length when it starts).
    lookahead: usize,
    epoch: Arc<AtomicU64>,
    /// Where this training loader stands (read by checkpoints).
    position: Arc<Mutex<StreamState>>,
}

impl<I, O> PreparedStreamLoader<I, O> {
    pub(crate) fn new(
        loader: StreamLoader<I, O>,
        (device, role): (Device, LoaderRole),
        (clock, links, comm): (LoopClock, LoaderLinks, Comm),
        accumulation_steps: usize,
    ) -> Result<Self, AccelerateError> {
        let (rank, world) = (comm.rank(), comm.world_size());
        check_world(&loader.config, world).map_err(|source| AccelerateError::Stream {
            rank,
            detail: source.to_string(),
        })?;
        let epoch = Arc::new(AtomicU64::new(0));
        let position = Arc::new(Mutex::new(StreamState::epoch_start(
            loader.config.clone(),
            0,
            (world, rank),
        )));
        if let LoaderRole::Train = role {
            links.register_stream(Arc::clone(&epoch), Arc::clone(&position), rank)?;
        }
        Ok(Self {
            loader,
            device,
            role,
            clock,
            links,
            comm,
            lookahead: accumulation_steps.saturating_add(1).max(2),
            epoch,
            position,
        })
    }

    /// Selects the epoch the next [`iter`](Self::iter) reads. After
    /// [`load_state`](crate::Accelerator::load_state) a training loader is already at the
    /// checkpoint's epoch, and its next `iter` continues where the saved run stopped.
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    /// The epoch the next [`iter`](Self::iter) reads.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// The loader as given to `prepare`.
    pub fn loader(&self) -> &StreamLoader<I, O> {
        &self.loader
    }

    /// Records where the training loader stands.
    fn set_position(&self, state: &StreamState) {
        if let LoaderRole::Train = self.role {
            *self.position.lock().unwrap_or_else(PoisonError::into_inner) = state.clone();
        }
    }
}
