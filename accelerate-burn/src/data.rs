//! Data loading: a loader described by a data set, a Burn batcher and a batch size, and its
//! prepared form that yields batches on the accelerator's device.
//!
//! Which samples a process visits, batch by batch, is decided by a
//! [`DistributedSampler`]: the epoch's order is a pure function of `(seed, epoch)`, the same on
//! every run, process and platform, which exact resume relies on, and each process takes its
//! share of every round. Burn's own loader shuffles with a generator it owns and has no
//! `set_epoch`, so we feed Burn's [`Batcher`] ourselves.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use accelerate_core::sampler::ShuffleOrder;
use accelerate_core::{BatchPosition, DistributedSampler, PieceLayout, RankBatches, SamplerConfig};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::tensor::Device;

use crate::error::AccelerateError;
use crate::loader_link::{BatchPadding, LoaderLinks, Skip};
use crate::prefetch::{Prefetcher, build_batch};
use crate::training_loop::LoopClock;

/// A data set, a batcher and how to cut the data into batches; give it to
/// [`Accelerator::prepare`](crate::Accelerator::prepare).
pub struct DataLoader<I, O> {
    dataset: Arc<dyn Dataset<I>>,
    batcher: Arc<dyn Batcher<I, O>>,
    sampling: SamplerConfig,
    /// Batches built ahead; `None`: the default of whoever prepares it.
    prefetch: Option<usize>,
    workers: usize,
}

/// Builds a [`DataLoader`], in the style of Burn's `DataLoaderBuilder`.
pub struct DataLoaderBuilder<I, O> {
    batcher: Arc<dyn Batcher<I, O>>,
    sampling: SamplerConfig,
    prefetch: Option<usize>,
    workers: usize,
}

/// Batches built ahead of the training loop by default.
pub const DEFAULT_PREFETCH: usize = 2;

impl<I, O> DataLoader<I, O> {
    /// Starts a loader that turns items into batches with `batcher` (batch size 1, in order).
    pub fn builder(batcher: impl Batcher<I, O> + 'static) -> DataLoaderBuilder<I, O> {
        DataLoaderBuilder {
            batcher: Arc::new(batcher),
            sampling: SamplerConfig {
                shuffle: false,
                ..SamplerConfig::new(0, 1, 0)
            },
            prefetch: None,
            workers: 1,
        }
    }

    /// The sampler of process `rank` of `world_size` over this loader's data.
    fn sampler(
        &self,
        rank: usize,
        world_size: usize,
    ) -> Result<DistributedSampler, AccelerateError> {
        DistributedSampler::new(self.sampling.clone(), rank, world_size)
            .map_err(|source| AccelerateError::Sampler { rank, source })
    }

    /// Items in the data set.
    pub fn dataset_len(&self) -> usize {
        self.dataset.len()
    }

    /// True when every process gets as many batches per epoch (see
    /// [`DataLoaderBuilder::even_batches`]).
    pub fn even_batches(&self) -> bool {
        self.sampling.even_batches
    }

    /// Items per batch (per process; the global batch with `split_batches`).
    pub fn batch_size(&self) -> usize {
        self.sampling.batch_size
    }

    /// Batches built ahead of the loop: as set with [`DataLoaderBuilder::prefetch`], else
    /// `default`.
    pub(crate) fn prefetch_or(&self, default: usize) -> usize {
        self.prefetch.unwrap_or(default)
    }

    /// With no `prefetch` set, builds batches on the loop's thread (burn-train's Learner
    /// loaders, as Burn's own loader does).
    #[cfg(feature = "train")]
    pub(crate) fn prefetch_by_default(mut self, batches: usize) -> Self {
        self.prefetch.get_or_insert(batches);
        self
    }

    /// The data-set indices a single process visits in epoch `epoch`, in order.
    pub fn epoch_indices(&self, epoch: u64) -> Vec<usize> {
        let Ok(mut single) = self.sampler(0, 1) else {
            return Vec::new();
        };
        single.set_epoch(epoch);
        single.batches().flat_map(|b| b.indices).collect()
    }
}

impl<I, O> DataLoaderBuilder<I, O> {
    /// Items per batch and process (at least 1); with [`split_batches`](Self::split_batches),
    /// items per global batch. Without it the global batch is `batch_size x processes`.
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.sampling.batch_size = batch_size.max(1);
        self
    }

    /// Visits each epoch in a shuffled order drawn from `(seed, epoch)`.
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.sampling.shuffle = true;
        self.sampling.seed = seed;
        self
    }

    /// How a shuffled order is made: [`ShuffleOrder::Drawn`] (the default, 8 bytes per item
    /// while an epoch runs) or [`ShuffleOrder::Keyed`] (computed at each position, no memory
    /// per item: for data sets larger than memory read at random, such as token windows).
    /// Part of what a checkpoint's loader state must match to resume.
    pub fn shuffle_order(mut self, order: ShuffleOrder) -> Self {
        self.sampling.order = order;
        self
    }

    /// Drops the last (global) batch of an epoch when it is short.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.sampling.drop_last = drop_last;
        self
    }

    /// With several processes, fills a short last round by cycling from the epoch's start so
    /// that every process gets the same number of full batches (default: true).
    pub fn even_batches(mut self, even_batches: bool) -> Self {
        self.sampling.even_batches = even_batches;
        self
    }

    /// Reads the data set in pieces of these lengths (in data-set order: Parquet row groups,
    /// files), shuffling items only within blocks of consecutive pieces of at least
    /// `shuffle_rows` items: each process then reads a contiguous stretch of the epoch's piece
    /// order, that is mostly its own pieces, instead of every piece. Exact resume holds, on the
    /// same and on another number of processes (see `accelerate_core::piece_order`). The
    /// pieces must add up to the data set's length (checked at `prepare`).
    pub fn pieces(mut self, lens: impl Into<Arc<[usize]>>, shuffle_rows: usize) -> Self {
        self.sampling.pieces = Some(PieceLayout::new(lens, shuffle_rows));
        self
    }

    /// Treats the batch size as the global batch, split evenly across processes.
    pub fn split_batches(mut self, split_batches: bool) -> Self {
        self.sampling.split_batches = split_batches;
        self
    }

    /// Builds up to `batches` batches ahead on background threads (default
    /// [`DEFAULT_PREFETCH`]; at least one per worker); 0 builds each batch on the loop's own
    /// thread when the loop asks for it.
    pub fn prefetch(mut self, batches: usize) -> Self {
        self.prefetch = Some(batches);
        self
    }

    /// Builds batches on `workers` threads (default 1; 0 counts as 1): worker `w` builds the
    /// epoch's batches `w`, `w + workers`, ... and the loop receives them in the epoch's order,
    /// so the batches are the same, bit for bit, whatever the number of workers (given a
    /// batcher that depends only on its items).
    pub fn num_workers(mut self, workers: usize) -> Self {
        self.workers = workers.max(1);
        self
    }

    /// Finishes the loader over `dataset`.
    pub fn build(mut self, dataset: impl Dataset<I> + 'static) -> DataLoader<I, O> {
        self.sampling.len = dataset.len();
        DataLoader {
            dataset: Arc::new(dataset),
            batcher: self.batcher,
            sampling: self.sampling,
            prefetch: self.prefetch,
            workers: self.workers,
        }
    }
}

/// What a prepared loader is for.
pub(crate) enum LoaderRole {
    /// Training: each batch's position drives the accumulation windows.
    Train,
    /// Evaluation: no effect on training state.
    Eval,
}

/// A loader prepared by an [`Accelerator`](crate::Accelerator): yields batches built on its
/// device, epoch by epoch.
pub struct PreparedDataLoader<I, O> {
    loader: DataLoader<I, O>,
    sampler: DistributedSampler,
    device: Device,
    role: LoaderRole,
    /// Ticked at every training batch.
    clock: LoopClock,
    links: LoaderLinks,
    rank: usize,
    /// Shared with the accelerator (training loaders), so that loading a checkpoint moves it.
    epoch: Arc<AtomicU64>,
}

impl<I, O> PreparedDataLoader<I, O> {
    pub(crate) fn new(
        loader: DataLoader<I, O>,
        device: Device,
        role: LoaderRole,
        (clock, links): (LoopClock, LoaderLinks),
        (rank, world_size): (usize, usize),
    ) -> Result<Self, AccelerateError> {
        let sampler = loader.sampler(rank, world_size)?;
        let epoch = Arc::new(AtomicU64::new(0));
        if let LoaderRole::Train = role {
            links.register_train(Arc::clone(&epoch), sampler.clone(), rank)?;
        }
        Ok(Self {
            sampler,
            loader,
            device,
            role,
            clock,
            links,
            rank,
            epoch,
        })
    }

    /// Selects the epoch whose order the next [`iter`](Self::iter) follows. After
    /// [`load_state`](crate::Accelerator::load_state) a training loader is already at the
    /// checkpoint's epoch, and its next `iter` over that epoch continues where the saved run
    /// stopped: write epoch loops as `for epoch in train.epoch()..epochs`.
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    /// The epoch the next [`iter`](Self::iter) follows.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Batches this process gets per epoch.
    pub fn len(&self) -> usize {
        self.sampler.len()
    }

    /// True when an epoch yields no batch.
    pub fn is_empty(&self) -> bool {
        self.sampler.is_empty()
    }

    /// The loader as given to `prepare`.
    pub fn loader(&self) -> &DataLoader<I, O> {
        &self.loader
    }
}

impl<I: 'static, O: Send + 'static> PreparedDataLoader<I, O> {
    /// Iterates over the batches of the current epoch, built on the accelerator's device
    /// (ahead of time on a background thread, unless the loader's `prefetch` is 0).
    pub fn iter(&self) -> BatchIter<'_, I, O> {
        self.iter_on(self.device.clone())
    }

    /// [`iter`](Self::iter) with batches built on `device` (the Learner's loaders follow the
    /// device the Learner moves them to).
    pub(crate) fn iter_on(&self, device: Device) -> BatchIter<'_, I, O> {
        let epoch = self.epoch();
        let mut sampler = self.sampler.clone();
        sampler.set_epoch(epoch);
        let (batches, first_index, epoch_len, padding) = match self.take_resume(epoch) {
            Some(Skip::Samples(start)) => (
                sampler.batches_from_sample(start),
                0,
                sampler.len_from_sample(start),
                sampler.last_round_padding_from_sample(start),
            ),
            Some(Skip::Pieces { consumed, batches }) => {
                let len = sampler.len_after(&consumed);
                (
                    sampler.batches_after(&consumed, batches),
                    batches.min(len),
                    len,
                    sampler.last_round_padding_after(&consumed),
                )
            }
            skip => {
                let skip = match skip {
                    Some(Skip::Batches(n)) => n,
                    _ => 0,
                };
                let len = sampler.len();
                (
                    sampler.batches_from(skip),
                    skip.min(len),
                    len,
                    sampler.last_round_padding(),
                )
            }
        };
        let prefetch = (self.loader.prefetch_or(DEFAULT_PREFETCH) > 0).then(|| {
            let loader = &self.loader;
            let source = (Arc::clone(&loader.dataset), Arc::clone(&loader.batcher));
            Prefetcher::start(
                source,
                (loader.workers, loader.prefetch_or(DEFAULT_PREFETCH)),
                device.clone(),
                batches.clone(),
            )
        });
        BatchIter {
            _evaluation: matches!(self.role, LoaderRole::Eval).then(crate::phases::evaluation),
            prepared: self,
            batches,
            epoch,
            next_batch: first_index,
            epoch_len,
            last_round_padding: padding,
            prefetch,
            device,
        }
    }

    /// For a training loader: takes the resume point of a loaded checkpoint when it is for
    /// `epoch`, and records that an iteration of `epoch` starts.
    fn take_resume(&self, epoch: u64) -> Option<Skip> {
        match self.role {
            LoaderRole::Train => self.links.begin_epoch(epoch),
            LoaderRole::Eval => None,
        }
    }
}

impl<'a, I: 'static, O: Send + 'static> IntoIterator for &'a PreparedDataLoader<I, O> {
    type Item = Result<O, AccelerateError>;
    type IntoIter = BatchIter<'a, I, O>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// The batches of one epoch of a [`PreparedDataLoader`].
pub struct BatchIter<'a, I, O> {
    prepared: &'a PreparedDataLoader<I, O>,
    batches: RankBatches,
    epoch: u64,
    next_batch: usize,
    /// Batches of the epoch as its accumulation windows count them.
    epoch_len: usize,
    /// Padding of the epoch's last round, over all processes.
    last_round_padding: usize,
    prefetch: Option<Prefetcher<O>>,
    /// Where batches are built.
    device: Device,
    /// An evaluation loader's pass, as a timeline phase (until the iterator is dropped).
    _evaluation: Option<tracing::Span>,
}

impl<I: 'static, O: Send + 'static> Iterator for BatchIter<'_, I, O> {
    type Item = Result<O, AccelerateError>;

    fn next(&mut self) -> Option<Self::Item> {
        let training = matches!(self.prepared.role, LoaderRole::Train);
        let wait = crate::phases::data_wait(if training { "train" } else { "eval" });
        let Some(batch) = self.batches.next() else {
            // The epoch is over: later gathers belong to no last batch.
            self.prepared.links.set_batch_padding(None);
            return None;
        };
        let index = self.next_batch;
        self.next_batch += 1;
        let prepared = self.prepared;
        if let LoaderRole::Train = prepared.role {
            prepared.clock.begin_batch(BatchPosition {
                index,
                epoch_len: self.epoch_len,
            });
            prepared.links.count_batch();
        }
        // `gather_for_metrics` drops the padding of the last round of samples.
        let padding = batch
            .last
            .then_some(BatchPadding::LastRound(self.last_round_padding));
        prepared.links.set_batch_padding(padding);
        let rank = prepared.rank;
        let loader = &self.prepared.loader;
        let built = match self.prefetch.as_mut() {
            Some(prefetch) => prefetch.next(),
            None => build_batch(
                loader.dataset.as_ref(),
                loader.batcher.as_ref(),
                &batch.indices,
                &self.device,
            ),
        };
        drop(wait);
        if training {
            crate::phases::batch_ready();
        }
        Some(built.map_err(|source| AccelerateError::Data {
            rank,
            epoch: self.epoch,
            batch: index,
            source,
        }))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.batches.size_hint()
    }
}

impl<I: 'static, O: Send + 'static> ExactSizeIterator for BatchIter<'_, I, O> {}
