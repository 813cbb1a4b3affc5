//! Threads that build a loader's batches ahead of the training loop, and the building of one
//! batch (load the items, run the batcher).

use std::sync::Arc;
use std::sync::mpsc::Receiver;
use std::thread::JoinHandle;

use accelerate_core::RankBatch;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::tensor::Device;

/// Where a loader's batches come from: its data set and its batcher, shared with the threads.
pub(crate) type BatchSource<I, O> = (Arc<dyn Dataset<I>>, Arc<dyn Batcher<I, O>>);

/// Loads the items of `indices` and runs the batcher.
pub(crate) fn build_batch<I, O>(
    dataset: &dyn Dataset<I>,
    batcher: &dyn Batcher<I, O>,
    indices: &[usize],
    device: &Device,
) -> Result<O, DatasetError> {
    let items = indices
        .iter()
        .map(|&i| dataset.get(i))
        .collect::<Result<Vec<I>, _>>()?;
    Ok(batcher.batch(items, device))
}

/// Threads building an epoch's batches, a bounded number ahead of the loop: worker `w` builds
/// batches `w`, `w + workers`, ... into its own channel, and the loop reads the channels in
/// turn, so batches arrive in the epoch's order.
pub(crate) struct Prefetcher<O> {
    built: Vec<Receiver<Result<O, DatasetError>>>,
    threads: Vec<Option<JoinHandle<()>>>,
    next: usize,
}

impl<O: Send + 'static> Prefetcher<O> {
    /// Starts `workers` threads building `batches` (made as they are needed) from `source`,
    /// up to `prefetch` batches ahead in all.
    pub fn start<I: 'static>(
        source: BatchSource<I, O>,
        (workers, prefetch): (usize, usize),
        device: Device,
        batches: impl ExactSizeIterator<Item = RankBatch> + Clone + Send + 'static,
    ) -> Self {
        let workers = workers.clamp(1, batches.len().max(1));
        let ahead = prefetch.div_ceil(workers).max(1);
        let (mut built, mut threads) = (Vec::new(), Vec::new());
        for worker in 0..workers {
            let (send, receive) = std::sync::mpsc::sync_channel(ahead);
            let dataset = Arc::clone(&source.0);
            let batcher = Arc::clone(&source.1);
            let (batches, device) = (batches.clone(), device.clone());
            let thread = std::thread::Builder::new()
                .name(format!("accelerate-loader-{worker}"))
                .spawn(move || {
                    // Each thread walks the batches and builds its own (the others are
                    // skipped without being made).
                    for rank_batch in batches.skip(worker).step_by(workers) {
                        let indices = &rank_batch.indices;
                        let batch =
                            build_batch(dataset.as_ref(), batcher.as_ref(), indices, &device);
                        // The loop stopped early (the iterator was dropped): stop too.
                        if send.send(batch).is_err() {
                            return;
                        }
                    }
                })
                .ok();
            built.push(receive);
            threads.push(thread);
        }
        Self {
            built,
            threads,
            next: 0,
        }
    }

    /// The next batch of the epoch, in order.
    pub fn next(&mut self) -> Result<O, DatasetError> {
        let worker = self.next % self.built.len();
        self.next += 1;
        match self.built[worker].recv() {
            Ok(batch) => batch,
            Err(_) => {
                // The thread ended early: a panic in the data set or batcher is re-raised
                // here, in the training loop, as if it had happened there.
                if let Some(Err(panic)) = self.threads[worker].take().map(JoinHandle::join) {
                    std::panic::resume_unwind(panic);
                }
                Err(DatasetError::new(std::io::Error::other(
                    "a loader thread could not be started or stopped early",
                )))
            }
        }
    }
}

impl<O> Drop for Prefetcher<O> {
    fn drop(&mut self) {
        // Closing the channels first lets threads blocked on a full channel finish.
        for built in &mut self.built {
            let (_, closed) = std::sync::mpsc::sync_channel(0);
            drop(std::mem::replace(built, closed));
        }
        for thread in self.threads.iter_mut().filter_map(Option::take) {
            let _ = thread.join();
        }
    }
}
