//! Our prepared loaders as Burn's `DataLoader` trait objects, which the Learner iterates:
//! every process gets its share of each round from the distributed sampler, in an order that
//! is a pure function of `(seed, epoch)`, so a resumed run sees the batches the uninterrupted
//! one saw.

use std::sync::Arc;

use burn::data::dataloader::{DataLoader as BurnDataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;
use burn::tensor::{DType, Device};

use crate::accelerator::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::data::{BatchIter, DataLoader, PreparedDataLoader};
use crate::error::AccelerateError;
use crate::precision::Autocast;

/// Casts a batch's float tensors to a dtype, and the dtype.
type BatchCast<O> = (fn(O, DType) -> O, DType);

/// A loader prepared for burn-train's Learner: give it to `SupervisedTraining::new` (made by
/// [`Accelerator::learner_loader`] / [`Accelerator::learner_eval_loader`]).
pub struct LearnerLoader<I, O> {
    prepared: Arc<PreparedDataLoader<I, O>>,
    /// Where batches are built (the Learner moves loaders to its devices).
    device: Device,
    /// Processes of the job: progress counts the items of every process's share.
    world: usize,
    /// Casts a batch's float tensors to the compute dtype (training loaders under bf16).
    cast: Option<BatchCast<O>>,
}

impl<B: AcceleratorBackend> Accelerator<B> {
    /// Prepares a training loader for burn-train's Learner (see
    /// [`AcceleratorStrategy`](crate::learner::AcceleratorStrategy)): this process's share of
    /// every round, shuffled by `(seed, epoch)` and advanced epoch by epoch by the strategy,
    /// so that a run resumed from a Learner checkpoint sees the batches of the uninterrupted
    /// one. Batches are built on the training thread, as Burn's own loader builds them,
    /// unless the loader sets [`prefetch`](crate::DataLoaderBuilder::prefetch) (on 2 cores a
    /// small model's epoch took 28 % longer with batches handed over from a thread).
    pub fn learner_loader<I, O>(
        &self,
        loader: DataLoader<I, O>,
    ) -> Result<Arc<dyn BurnDataLoader<O>>, AccelerateError>
    where
        I: Send + Sync + 'static,
        O: Send + 'static,
    {
        self.learner_train_loader(loader, None)
    }

    /// [`learner_loader`](Self::learner_loader) for batches that implement [`Autocast`]: under
    /// `mixed_precision: bf16` their float tensors arrive in bf16, as the bf16 copy of the
    /// weights that the training step runs on needs (Burn's operations do not mix dtypes).
    /// Without mixed precision it is `learner_loader`.
    pub fn learner_loader_autocast<I, O>(
        &self,
        loader: DataLoader<I, O>,
    ) -> Result<Arc<dyn BurnDataLoader<O>>, AccelerateError>
    where
        I: Send + Sync + 'static,
        O: Autocast + Send + 'static,
    {
        let dtype = self.compute_dtype();
        let cast = (dtype != DType::F32).then_some((O::autocast as fn(O, DType) -> O, dtype));
        self.learner_train_loader(loader, cast)
    }

    /// The training loader of both: `cast` (under mixed precision) turns each batch to the
    /// compute dtype; without it the strategy refuses mixed precision.
    fn learner_train_loader<I, O>(
        &self,
        loader: DataLoader<I, O>,
        cast: Option<BatchCast<O>>,
    ) -> Result<Arc<dyn BurnDataLoader<O>>, AccelerateError>
    where
        I: Send + Sync + 'static,
        O: Send + 'static,
    {
        self.check_even(&loader, "training")?;
        let prepared = self.prepare_data_loader(loader.prefetch_by_default(0))?;
        self.links.note_learner_train(cast.is_some());
        Ok(self.as_learner_loader(prepared, cast))
    }

    /// Prepares an evaluation loader for burn-train's Learner: this process's share of the
    /// validation set; the strategy gathers every process's outputs for the metrics without
    /// the samples `even_batches` repeated.
    pub fn learner_eval_loader<I, O>(
        &self,
        loader: DataLoader<I, O>,
    ) -> Result<Arc<dyn BurnDataLoader<O>>, AccelerateError>
    where
        I: Send + Sync + 'static,
        O: Send + 'static,
    {
        self.check_even(&loader, "validation")?;
        let prepared = self.prepare_eval_data_loader(loader.prefetch_by_default(0))?;
        self.links.note_eval_loader();
        Ok(self.as_learner_loader(prepared, None))
    }

    fn as_learner_loader<I, O>(
        &self,
        prepared: PreparedDataLoader<I, O>,
        cast: Option<BatchCast<O>>,
    ) -> Arc<dyn BurnDataLoader<O>>
    where
        I: Send + Sync + 'static,
        O: Send + 'static,
    {
        Arc::new(LearnerLoader {
            device: self.device(),
            prepared: Arc::new(prepared),
            world: self.num_processes(),
            cast,
        })
    }

    /// The strategy gathers every batch's outputs across the processes, so each must get as
    /// many batches.
    fn check_even<I, O>(
        &self,
        loader: &DataLoader<I, O>,
        role: &str,
    ) -> Result<(), AccelerateError> {
        if self.num_processes() > 1 && !loader.even_batches() {
            return Err(AccelerateError::Misuse {
                rank: self.process_index(),
                what: format!(
                    "a {role} loader without even_batches for the Learner on {} processes",
                    self.num_processes()
                ),
                hint: "keep even_batches(true) (the default): the Learner's strategy gathers \
                       every batch's outputs across the processes, so each needs as many batches",
            });
        }
        Ok(())
    }
}

impl<I, O> BurnDataLoader<O> for LearnerLoader<I, O>
where
    I: Send + Sync + 'static,
    O: Send + 'static,
{
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        let batches = self.prepared.iter_on(self.device.clone());
        let total = self.num_items();
        let per_batch = self.prepared.loader().batch_size() * self.world;
        Box::new(LearnerBatches {
            batches,
            done: 0,
            per_batch,
            total,
            cast: self.cast,
        })
    }

    /// Items of one epoch over every process (the progress the main process shows is the
    /// job's).
    fn num_items(&self) -> usize {
        self.prepared.loader().dataset_len()
    }

    fn to_device(&self, device: &Device) -> Arc<dyn BurnDataLoader<O>> {
        Arc::new(LearnerLoader {
            prepared: Arc::clone(&self.prepared),
            device: device.clone(),
            world: self.world,
            cast: self.cast,
        })
    }

    /// The processes already cut the data between them (Burn's DDP slices its loader per
    /// device): a slice of a prepared loader is the loader itself.
    fn slice(&self, _start: usize, _end: usize) -> Arc<dyn BurnDataLoader<O>> {
        self.to_device(&self.device)
    }
}

/// One epoch of a [`LearnerLoader`].
struct LearnerBatches<'a, I, O> {
    batches: BatchIter<'a, I, O>,
    /// Batches handed out.
    done: usize,
    /// Items of one round over every process.
    per_batch: usize,
    total: usize,
    cast: Option<BatchCast<O>>,
}

impl<I: 'static, O: Send + 'static> Iterator for LearnerBatches<'_, I, O> {
    type Item = Result<O, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        let batch = self.batches.next()?;
        self.done += 1;
        let batch = match (batch, self.cast) {
            (Ok(batch), Some((cast, dtype))) => Ok(cast(batch, dtype)),
            (batch, _) => batch,
        };
        Some(batch.map_err(DatasetError::new))
    }
}

impl<I: 'static, O: Send + 'static> DataLoaderIterator<O> for LearnerBatches<'_, I, O> {
    /// Items of the epoch processed by every process together; complete at the last batch
    /// (the rounds `even_batches` filled count once).
    fn progress(&self) -> Progress {
        let items = if self.batches.len() == 0 {
            self.total
        } else {
            (self.done * self.per_batch).min(self.total)
        };
        Progress::new(items, self.total, Some("items".to_string()))
    }
}
