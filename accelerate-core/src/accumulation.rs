//! Gradient accumulation windows: which micro-batch completes an update, and how large its
//! window really is.
//!
//! With `N` accumulation steps, the batches of an epoch form windows of `N` that start at the
//! epoch's first batch; the last window of an epoch holds what is left (`epoch_len % N`
//! batches when that is not zero). Each micro-batch's loss is divided by the length of *its*
//! window, so a short last window is weighted by its real size. (Hugging Face Accelerate divides
//! by `N` there, under-weighting those samples; we do not.)
//!
//! The training data loader reports each batch's position with [`GradientAccumulation::begin_batch`];
//! an evaluation loader does not, so evaluating between micro-batches leaves windows alone.
//! Without a loader (a hand-written loop), windows are counted by backward passes.

/// Where a training batch sits in its epoch, as reported by the data loader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPosition {
    /// Index of the batch within the epoch, from 0.
    pub index: usize,
    /// Number of batches in the epoch.
    pub epoch_len: usize,
}

/// What one backward pass must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MicroStep {
    /// Number of micro-batches in this micro-batch's window; the loss is divided by it.
    pub window_len: usize,
    /// True when this micro-batch completes its window: gradients are synchronised and the
    /// optimizer steps.
    pub sync: bool,
    /// True when this micro-batch opens a window: accumulated gradients start from zero.
    pub first: bool,
}

/// The accumulation state machine of one training loop (no tensors).
#[derive(Debug, Clone)]
pub struct GradientAccumulation {
    steps: usize,
    position: Option<BatchPosition>,
    current: Option<MicroStep>,
    pending: usize,
    update_due: bool,
    updates: u64,
}

impl GradientAccumulation {
    /// A state machine summing `steps` micro-batches per update (`steps` is at least 1).
    pub fn new(steps: usize) -> Self {
        Self {
            steps: steps.max(1),
            position: None,
            current: None,
            pending: 0,
            update_due: false,
            updates: 0,
        }
    }

    /// Micro-batches per update.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Called by the training loader as it hands out a batch. Returns the number of stale
    /// micro-batches dropped because the loader restarted in the middle of a window (their
    /// gradients belong to no update and must be discarded); normally 0.
    pub fn begin_batch(&mut self, position: BatchPosition) -> usize {
        self.position = Some(position);
        let expected = position.index % self.steps;
        if self.pending > expected {
            let stale = self.pending;
            self.pending = 0;
            tracing::warn!(
                stale,
                batch = position.index,
                "the training data restarted in the middle of an accumulation window: \
                 dropping the gradients of {stale} micro-batch(es) that belong to no update"
            );
            return stale;
        }
        0
    }

    /// Called once per backward pass: decides the window length and whether this micro-batch
    /// completes an update.
    pub fn micro_step(&mut self) -> MicroStep {
        let first = self.pending == 0;
        let (window_len, sync) = match self.position.take() {
            Some(BatchPosition { index, epoch_len }) => {
                let start = index - index % self.steps;
                let window_len = self.steps.min(epoch_len.saturating_sub(start)).max(1);
                (window_len, index + 1 >= start + window_len)
            }
            None => (self.steps, self.pending + 1 >= self.steps),
        };
        self.pending = if sync { 0 } else { self.pending + 1 };
        self.update_due = sync;
        let step = MicroStep {
            window_len,
            sync,
            first,
        };
        self.current = Some(step);
        step
    }

    /// True when the latest micro-batch completes a window (also before the first one, as
    /// with Accelerate's `sync_gradients`).
    pub fn sync_gradients(&self) -> bool {
        self.current.is_none_or(|s| s.sync)
    }

    /// Claims the update that the latest micro-batch completed. Returns false when there is
    /// none to claim (a non-final micro-batch, or an update already taken), in which case the
    /// optimizer must not step.
    pub fn take_update(&mut self) -> bool {
        let due = std::mem::take(&mut self.update_due);
        if due {
            self.updates += 1;
        }
        due
    }

    /// Drops the update the latest micro-batch completed without counting it (a skipped step:
    /// its gradients overflowed). Schedules, which count updates, do not advance.
    pub fn skip_update(&mut self) {
        self.update_due = false;
    }

    /// True when an update is due and not yet taken.
    pub fn update_due(&self) -> bool {
        self.update_due
    }

    /// Optimizer updates taken so far.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Micro-batches summed in the open window (0 at a window boundary, where a checkpoint
    /// can be taken).
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// Continues from a checkpoint taken at a window boundary after `updates` updates.
    pub fn restore(&mut self, updates: u64) {
        *self = Self {
            updates,
            ..Self::new(self.steps)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs one epoch of `len` batches and returns (window_len, sync) per batch.
    fn epoch(acc: &mut GradientAccumulation, len: usize) -> Vec<(usize, bool)> {
        (0..len)
            .map(|index| {
                acc.begin_batch(BatchPosition {
                    index,
                    epoch_len: len,
                });
                let s = acc.micro_step();
                (s.window_len, s.sync)
            })
            .collect()
    }

    #[test]
    fn windows_start_each_epoch_and_the_last_one_is_short() {
        let mut acc = GradientAccumulation::new(4);
        let e = epoch(&mut acc, 10);
        let lens: Vec<_> = e.iter().map(|x| x.0).collect();
        let syncs: Vec<_> = e.iter().map(|x| x.1).collect();
        assert_eq!(lens, [4, 4, 4, 4, 4, 4, 4, 4, 2, 2]);
        assert_eq!(
            syncs,
            [
                false, false, false, true, false, false, false, true, false, true
            ]
        );
        // The next epoch starts a fresh window.
        let e2 = epoch(&mut acc, 10);
        assert_eq!(e, e2);
    }

    #[test]
    fn one_step_syncs_every_batch() {
        let mut acc = GradientAccumulation::new(1);
        assert!(epoch(&mut acc, 5).iter().all(|&(l, s)| l == 1 && s));
    }

    #[test]
    fn every_window_has_one_update_for_many_shapes() {
        for steps in 1..=6 {
            for len in 0..=13 {
                let mut acc = GradientAccumulation::new(steps);
                let e = epoch(&mut acc, len);
                let updates = e.iter().filter(|x| x.1).count();
                assert_eq!(updates, len.div_ceil(steps), "steps {steps}, len {len}");
                // Window lengths sum to the epoch length when each is counted once per batch.
                let weight: f64 = e.iter().map(|x| 1.0 / x.0 as f64).sum();
                assert!((weight - updates as f64).abs() < 1e-9);
            }
        }
    }

    #[test]
    fn without_a_loader_windows_count_backward_passes() {
        let mut acc = GradientAccumulation::new(3);
        let syncs: Vec<_> = (0..7).map(|_| acc.micro_step().sync).collect();
        assert_eq!(syncs, [false, false, true, false, false, true, false]);
    }

    #[test]
    fn a_restart_mid_window_drops_the_stale_micro_batches() {
        let mut acc = GradientAccumulation::new(4);
        for index in 0..2 {
            assert_eq!(
                acc.begin_batch(BatchPosition {
                    index,
                    epoch_len: 8
                }),
                0
            );
            assert!(!acc.micro_step().sync);
        }
        // The loader starts over (a new epoch after a `break`).
        assert_eq!(
            acc.begin_batch(BatchPosition {
                index: 0,
                epoch_len: 8
            }),
            2
        );
        let step = acc.micro_step();
        assert!(step.first && !step.sync);
    }

    #[test]
    fn evaluation_between_micro_batches_does_not_disturb_windows() {
        // An evaluation loader never calls begin_batch, so only training positions count.
        let mut acc = GradientAccumulation::new(2);
        acc.begin_batch(BatchPosition {
            index: 0,
            epoch_len: 4,
        });
        assert!(!acc.micro_step().sync);
        acc.begin_batch(BatchPosition {
            index: 1,
            epoch_len: 4,
        });
        assert!(acc.micro_step().sync);
    }

    #[test]
    fn a_skipped_update_is_not_counted() {
        let mut acc = GradientAccumulation::new(1);
        acc.micro_step();
        acc.skip_update();
        assert!(!acc.take_update());
        assert_eq!(acc.updates(), 0);
        acc.micro_step();
        assert!(acc.take_update());
        assert_eq!(acc.updates(), 1);
    }

    #[test]
    fn updates_are_taken_once() {
        let mut acc = GradientAccumulation::new(2);
        assert!(acc.sync_gradients());
        acc.micro_step();
        assert!(!acc.sync_gradients());
        assert!(!acc.take_update());
        acc.micro_step();
        assert!(acc.sync_gradients() && acc.update_due());
        assert!(acc.take_update());
        assert!(!acc.take_update());
        assert_eq!(acc.updates(), 1);
    }
}
