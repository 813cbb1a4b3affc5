//! Data loading: a loader described by a data set, a Burn batcher and a batch size, and its
//! prepared form that yields batches on the accelerator's device.
//!
//! The order of an epoch is [`accelerate_core::sampler::epoch_order`] of `(seed, epoch)`, a pure
//! function: the same on every run and platform, which exact resume relies on. Burn's own
//! loader shuffles with a generator it owns and has no `set_epoch`, so we feed Burn's
//! [`Batcher`] ourselves.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use accelerate_core::BatchPosition;
use accelerate_core::sampler::epoch_order;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::tensor::Device;

use crate::error::AccelerateError;
use crate::loop_state::SharedLoop;

/// A data set, a batcher and how to cut the data into batches; give it to
/// [`Accelerator::prepare`](crate::Accelerator::prepare).
pub struct DataLoader<I, O> {
    dataset: Arc<dyn Dataset<I>>,
    batcher: Arc<dyn Batcher<I, O>>,
    batch_size: usize,
    shuffle: Option<u64>,
    drop_last: bool,
}

/// Builds a [`DataLoader`], in the style of Burn's `DataLoaderBuilder`.
pub struct DataLoaderBuilder<I, O> {
    batcher: Arc<dyn Batcher<I, O>>,
    batch_size: usize,
    shuffle: Option<u64>,
    drop_last: bool,
}

impl<I, O> DataLoader<I, O> {
    /// Starts a loader that turns items into batches with `batcher` (batch size 1, in order).
    pub fn builder(batcher: impl Batcher<I, O> + 'static) -> DataLoaderBuilder<I, O> {
        DataLoaderBuilder {
            batcher: Arc::new(batcher),
            batch_size: 1,
            shuffle: None,
            drop_last: false,
        }
    }

    /// Items in the data set.
    pub fn dataset_len(&self) -> usize {
        self.dataset.len()
    }

    /// Items per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Batches per epoch.
    pub fn len(&self) -> usize {
        if self.drop_last {
            self.dataset.len() / self.batch_size
        } else {
            self.dataset.len().div_ceil(self.batch_size)
        }
    }

    /// True when an epoch yields no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The data-set indices of epoch `epoch`, in visiting order.
    pub fn epoch_indices(&self, epoch: u64) -> Vec<usize> {
        let shuffle = self.shuffle.is_some();
        let mut order = epoch_order(
            self.dataset.len(),
            shuffle,
            self.shuffle.unwrap_or(0),
            epoch,
        );
        order.truncate(self.len() * self.batch_size);
        order
    }
}

impl<I, O> DataLoaderBuilder<I, O> {
    /// Items per batch (at least 1).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// Visits each epoch in a shuffled order drawn from `(seed, epoch)`.
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.shuffle = Some(seed);
        self
    }

    /// Drops the last batch of an epoch when it is smaller than the batch size.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Finishes the loader over `dataset`.
    pub fn build(self, dataset: impl Dataset<I> + 'static) -> DataLoader<I, O> {
        DataLoader {
            dataset: Arc::new(dataset),
            batcher: self.batcher,
            batch_size: self.batch_size,
            shuffle: self.shuffle,
            drop_last: self.drop_last,
        }
    }
}

/// What a prepared loader is for.
pub(crate) enum LoaderRole {
    /// Training: each batch's position drives the accumulation windows.
    Train(SharedLoop),
    /// Evaluation: no effect on training state.
    Eval { rank: usize },
}

/// A loader prepared by an [`Accelerator`](crate::Accelerator): yields batches built on its
/// device, epoch by epoch.
pub struct PreparedDataLoader<I, O> {
    loader: DataLoader<I, O>,
    device: Device,
    role: LoaderRole,
    epoch: AtomicU64,
}

impl<I, O> PreparedDataLoader<I, O> {
    pub(crate) fn new(loader: DataLoader<I, O>, device: Device, role: LoaderRole) -> Self {
        Self {
            loader,
            device,
            role,
            epoch: AtomicU64::new(0),
        }
    }

    /// Selects the epoch whose order the next [`iter`](Self::iter) follows.
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    /// The epoch the next [`iter`](Self::iter) follows.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Batches per epoch.
    pub fn len(&self) -> usize {
        self.loader.len()
    }

    /// True when an epoch yields no batch.
    pub fn is_empty(&self) -> bool {
        self.loader.is_empty()
    }

    /// The loader as given to `prepare`.
    pub fn loader(&self) -> &DataLoader<I, O> {
        &self.loader
    }

    /// Iterates over the batches of the current epoch, built on the accelerator's device.
    pub fn iter(&self) -> BatchIter<'_, I, O> {
        let epoch = self.epoch();
        BatchIter {
            prepared: self,
            order: self.loader.epoch_indices(epoch),
            epoch,
            next_batch: 0,
        }
    }
}

impl<'a, I, O> IntoIterator for &'a PreparedDataLoader<I, O> {
    type Item = Result<O, AccelerateError>;
    type IntoIter = BatchIter<'a, I, O>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// The batches of one epoch of a [`PreparedDataLoader`].
pub struct BatchIter<'a, I, O> {
    prepared: &'a PreparedDataLoader<I, O>,
    order: Vec<usize>,
    epoch: u64,
    next_batch: usize,
}

impl<I, O> Iterator for BatchIter<'_, I, O> {
    type Item = Result<O, AccelerateError>;

    fn next(&mut self) -> Option<Self::Item> {
        let loader = &self.prepared.loader;
        let start = self.next_batch * loader.batch_size;
        if start >= self.order.len() {
            return None;
        }
        let end = (start + loader.batch_size).min(self.order.len());
        let index = self.next_batch;
        self.next_batch += 1;
        let rank = match &self.prepared.role {
            LoaderRole::Train(shared) => {
                let mut shared = shared.lock();
                shared.accumulation.begin_batch(BatchPosition {
                    index,
                    epoch_len: loader.len(),
                });
                shared.rank
            }
            LoaderRole::Eval { rank } => *rank,
        };
        let items = self.order[start..end]
            .iter()
            .map(|&i| loader.dataset.get(i))
            .collect::<Result<Vec<I>, _>>()
            .map_err(|source| AccelerateError::Data {
                rank,
                epoch: self.epoch,
                batch: index,
                source,
            });
        Some(items.map(|items| loader.batcher.batch(items, &self.prepared.device)))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.prepared.loader.len().saturating_sub(self.next_batch);
        (left, Some(left))
    }
}

impl<I, O> ExactSizeIterator for BatchIter<'_, I, O> {}
