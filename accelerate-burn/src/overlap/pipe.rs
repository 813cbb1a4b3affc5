//! The gradient pipe: one window's gradients, handed in parameter by parameter as they become
//! final, averaged over the processes bucket by bucket. The same [`Averager`] runs on the
//! caller's thread (gradients handed in after backward) or on a communication thread that
//! the units' taps feed during backward: the buckets, their order and every addition are the
//! same, so the two give the same bits.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use accelerate_core::MixedPrecision;
use burn::module::ParamId;

use crate::error::AccelerateError;
use crate::group::Comm;
use crate::params::ParamLayout;
use crate::reducer::wire::Wire;

/// How a window's gradients are cut into buckets, and the order the buckets are sent in.
pub(crate) struct PipePlan {
    /// Elements of each layout entry.
    numel: Vec<usize>,
    /// Entries that never get a gradient (not trained).
    frozen: Vec<bool>,
    /// Ranges of layout entries averaged together.
    buckets: Vec<Range<usize>>,
    /// The bucket of each entry.
    bucket_of: Vec<usize>,
    /// Bucket indices in the order every process sends them: the buckets of units from the
    /// last to the first (the order backward finishes them), then the others, last first.
    order: Vec<usize>,
    /// Some bucket belongs to a unit (taps can fill it during backward).
    pub has_units: bool,
}

impl PipePlan {
    /// Buckets of consecutive entries of at least `bucket_bytes` (f32), cut also wherever the
    /// unit changes (`unit_of`), so that a unit's bucket is complete when backward leaves it
    /// ([`ParamLayout::buckets`]).
    pub fn new(
        layout: &ParamLayout,
        bucket_bytes: usize,
        unit_of: impl Fn(ParamId) -> Option<u64>,
    ) -> Self {
        let buckets = layout.buckets(bucket_bytes, &unit_of);
        let mut bucket_of = vec![0; layout.entries.len()];
        for (b, range) in buckets.iter().enumerate() {
            for entry in range.clone() {
                bucket_of[entry] = b;
            }
        }
        let of_unit = |b: &usize| unit_of(layout.entries[buckets[*b].start].id).is_some();
        let (mut order, others): (Vec<usize>, Vec<usize>) =
            (0..buckets.len()).rev().partition(of_unit);
        let has_units = !order.is_empty();
        order.extend(others);
        Self {
            numel: layout.entries.iter().map(|e| e.numel).collect(),
            frozen: layout.entries.iter().map(|e| !e.trainable).collect(),
            buckets,
            bucket_of,
            order,
            has_units,
        }
    }

    /// Layout entries.
    pub fn len(&self) -> usize {
        self.numel.len()
    }

    /// Whether entry `i` never gets a gradient (handed in as absent from the start).
    pub fn frozen(&self, i: usize) -> bool {
        self.frozen.get(i).copied().unwrap_or(true)
    }

    /// Per entry, whether it is handed in before backward runs: the frozen ones.
    pub fn handed_in_at_start(&self) -> Vec<bool> {
        self.frozen.clone()
    }
}

/// One parameter's gradient of the window's last micro-batch, as it reaches the pipe.
pub(crate) enum Delivery {
    /// Its values (f32, flattened).
    Grad { entry: usize, values: Vec<f32> },
    /// It has no gradient in this micro-batch.
    Absent { entry: usize },
}

/// One bucket averaged: its trained entries' values, concatenated.
pub(crate) struct AveragedBucket {
    /// The entries some process had a gradient for, in layout order, each with its place in
    /// `values`.
    pub entries: Vec<(usize, Range<usize>)>,
    pub values: Vec<f32>,
}

/// What a window's averaging starts from besides the last micro-batch's gradients.
pub(crate) struct WindowStart {
    /// The sum of the window's earlier micro-batches (host, f32, per entry), added first.
    pub held: Vec<Option<Vec<f32>>>,
    /// The per-item factor of a window of summed losses, applied after the sum.
    pub factor: Option<f32>,
}

/// The state machine both runners drive: entries filled in, buckets sent in plan order as
/// soon as each is complete.
pub(crate) struct Averager {
    plan: Arc<PipePlan>,
    start: WindowStart,
    /// Per entry: `None` while waiting, then its gradient (or none).
    slots: Vec<Option<Option<Vec<f32>>>>,
    /// Entries still waiting, per bucket.
    waiting: Vec<usize>,
    /// The next bucket to send (an index into the plan's order).
    next: usize,
    wire: Wire,
    comm: Comm,
    done: Vec<AveragedBucket>,
    /// The bucket before which this process aborts, on a communication thread (tests).
    fault_at: Option<u64>,
}

/// Fault injection for tests: `<rank>:<n>` aborts rank `<rank>` on its communication thread
/// before the n-th bucket it sends there (counting from 1 over the process's life): a rank
/// that dies in the middle of overlapped communication.
const FAULT_AT: &str = "ACCELERATE_FAULT_OVERLAP_AT";

/// Buckets sent by communication threads in this process so far.
static SENT_ON_THREADS: AtomicU64 = AtomicU64::new(0);

impl Averager {
    pub fn new(plan: Arc<PipePlan>, start: WindowStart, wire: MixedPrecision, comm: Comm) -> Self {
        let mut waiting: Vec<usize> = plan.buckets.iter().map(Range::len).collect();
        let mut slots = vec![None; plan.len()];
        for (i, slot) in slots.iter_mut().enumerate() {
            if plan.frozen(i) {
                *slot = Some(None);
                waiting[plan.bucket_of[i]] -= 1;
            }
        }
        Self {
            plan,
            start,
            slots,
            waiting,
            next: 0,
            wire: Wire::new(wire),
            comm,
            done: Vec::new(),
            fault_at: None,
        }
    }

    /// Takes one entry's gradient and sends every bucket that is now due.
    pub fn receive(&mut self, delivery: Delivery) -> Result<(), AccelerateError> {
        let (entry, grad) = match delivery {
            Delivery::Grad { entry, values } => (entry, Some(values)),
            Delivery::Absent { entry } => (entry, None),
        };
        let rank = self.comm.rank();
        let slot = self
            .slots
            .get_mut(entry)
            .ok_or(AccelerateError::UnexpectedGradients { rank })?;
        if slot.is_some() {
            return Err(AccelerateError::Misuse {
                rank,
                what: "a unit's parameter got two gradients in one backward pass (the unit \
                       ran twice, or its parameter is also used outside it)"
                    .into(),
                hint: "call whole_for once per unit and forward pass and keep tied weights out \
                       of units, or turn overlap off (overlap_communication(false))",
            });
        }
        let held = self.start.held.get_mut(entry).and_then(Option::take);
        let mut grad = match (held, grad) {
            (Some(mut sum), Some(values)) if sum.len() == values.len() => {
                for (total, g) in sum.iter_mut().zip(&values) {
                    *total += g;
                }
                Some(sum)
            }
            (Some(sum), None) => Some(sum),
            (_, grad) => grad,
        };
        if let (Some(factor), Some(values)) = (self.start.factor, grad.as_mut()) {
            for v in values.iter_mut() {
                *v *= factor;
            }
        }
        *slot = Some(grad);
        self.waiting[self.plan.bucket_of[entry]] -= 1;
        self.send_due()
    }

    /// Sends the buckets that are complete, in plan order. A bucket carries every trained
    /// entry (zeros where this process has no gradient) and, after them, one flag per entry
    /// (1 where it has one): the lengths match on every process whatever each one's backward
    /// reached, and an entry any process had a gradient for is averaged with the others'
    /// zeros, as one process over the global batch would see it; one no process had stays
    /// without a gradient.
    fn send_due(&mut self) -> Result<(), AccelerateError> {
        while let Some(&b) = self.plan.order.get(self.next) {
            if self.waiting[b] > 0 {
                return Ok(());
            }
            self.next += 1;
            let trained: Vec<usize> = self.plan.buckets[b]
                .clone()
                .filter(|&e| !self.plan.frozen(e))
                .collect();
            if trained.is_empty() {
                continue;
            }
            let len: usize = trained.iter().map(|&e| self.plan.numel[e]).sum();
            let mut values = Vec::with_capacity(len + trained.len());
            let mut flags = Vec::with_capacity(trained.len());
            for &entry in &trained {
                let numel = self.plan.numel[entry];
                match self.slots[entry].replace(None).flatten() {
                    Some(grad) if grad.len() == numel => {
                        values.extend_from_slice(&grad);
                        flags.push(1.0);
                    }
                    _ => {
                        values.resize(values.len() + numel, 0.0);
                        flags.push(0.0);
                    }
                }
            }
            values.extend_from_slice(&flags);
            if let Some(at) = self.fault_at {
                let sent = SENT_ON_THREADS.fetch_add(1, Ordering::Relaxed) + 1;
                if sent == at {
                    eprintln!("{FAULT_AT}: aborting before bucket {sent}");
                    std::process::abort();
                }
            }
            let wire = &mut self.wire;
            self.comm
                .timed(|group| wire.all_reduce_mean(&mut values, group))?;
            let mut entries = Vec::with_capacity(trained.len());
            let mut offset = 0;
            for (i, &entry) in trained.iter().enumerate() {
                let numel = self.plan.numel[entry];
                // Means of flags: positive wherever some process had a gradient.
                if values[len + i] > 0.0 {
                    entries.push((entry, offset..offset + numel));
                }
                offset += numel;
            }
            values.truncate(len);
            self.done.push(AveragedBucket { entries, values });
        }
        Ok(())
    }

    /// The averaged buckets, once every entry was handed in.
    fn finish(self) -> Result<Vec<AveragedBucket>, AccelerateError> {
        if self.next < self.plan.order.len() {
            return Err(AccelerateError::UnexpectedGradients {
                rank: self.comm.rank(),
            });
        }
        Ok(self.done)
    }
}

/// Where the [`Averager`] of a window runs.
pub(crate) enum PipeRun {
    /// On the caller's thread, as gradients are handed in.
    Inline(Box<Averager>),
    /// On a communication thread fed by a channel (the taps hold clones of the sender).
    Thread {
        sender: Sender<Delivery>,
        thread: JoinHandle<Result<Vec<AveragedBucket>, AccelerateError>>,
    },
}

impl PipeRun {
    /// The averager on a thread of its own.
    pub fn spawn(mut averager: Averager) -> Result<Self, AccelerateError> {
        let (sender, receiver) = channel();
        let rank = averager.comm.rank();
        averager.fault_at = crate::fault::fault_at(FAULT_AT, rank);
        let thread = std::thread::Builder::new()
            .name("accelerate-overlap".into())
            .spawn(move || run(averager, receiver))
            .map_err(|e| AccelerateError::Misuse {
                rank,
                what: format!("starting the communication thread failed: {e}"),
                hint: "the system refuses new threads; turn overlap off \
                       (ACCELERATE_OVERLAP_COMMUNICATION=false)",
            })?;
        Ok(Self::Thread { sender, thread })
    }

    /// A sender for the taps (`None` inline).
    pub fn sender(&self) -> Option<Sender<Delivery>> {
        match self {
            Self::Inline(_) => None,
            Self::Thread { sender, .. } => Some(sender.clone()),
        }
    }

    /// Hands in one entry's gradient.
    pub fn deliver(&mut self, delivery: Delivery) -> Result<(), AccelerateError> {
        match self {
            Self::Inline(averager) => averager.receive(delivery),
            // A thread that stopped reports why at `finish`.
            Self::Thread { sender, .. } => {
                let _ = sender.send(delivery);
                Ok(())
            }
        }
    }

    /// Waits for every bucket and returns them averaged.
    pub fn finish(self, rank: usize) -> Result<Vec<AveragedBucket>, AccelerateError> {
        match self {
            Self::Inline(averager) => averager.finish(),
            Self::Thread { sender, thread } => {
                drop(sender);
                thread.join().map_err(|_| AccelerateError::Misuse {
                    rank,
                    what: "the communication thread panicked".into(),
                    hint: "turn overlap off (ACCELERATE_OVERLAP_COMMUNICATION=false) and \
                               report the bug",
                })?
            }
        }
    }
}

/// The communication thread: averages what arrives until every sender is gone.
fn run(
    mut averager: Averager,
    receiver: Receiver<Delivery>,
) -> Result<Vec<AveragedBucket>, AccelerateError> {
    for delivery in receiver {
        averager.receive(delivery)?;
    }
    averager.finish()
}

#[cfg(test)]
mod tests {
    use accelerate_core::comm::{GroupOptions, ProcessGroup};

    use super::*;
    use crate::params::ParamEntry;

    /// Entries of `numels` elements (0 elements: frozen), units as given.
    fn layout(numels: &[usize]) -> ParamLayout {
        ParamLayout {
            entries: numels
                .iter()
                .enumerate()
                .map(|(i, &n)| ParamEntry {
                    id: ParamId::from(i as u64 + 1),
                    path: format!("p{i}"),
                    shape: vec![n.max(1)],
                    numel: n.max(1),
                    trainable: n > 0,
                })
                .collect(),
        }
    }

    fn start() -> WindowStart {
        WindowStart {
            held: Vec::new(),
            factor: None,
        }
    }

    #[test]
    fn buckets_are_cut_at_units_and_sent_last_unit_first_then_the_rest() {
        // Entries 0-1 outside units, 2-3 unit 0, 4-5 unit 1, 6 outside.
        let units = [None, None, Some(0), Some(0), Some(1), Some(1), None];
        let plan = PipePlan::new(&layout(&[4; 7]), 1 << 20, |id| {
            units[(id.val() - 1) as usize]
        });
        assert_eq!(plan.buckets, [0..2, 2..4, 4..6, 6..7]);
        assert_eq!(plan.order, [2, 1, 3, 0]);
        assert!(plan.has_units);
        // A small bucket size also cuts inside a unit; no units: layout order, last first.
        let plan = PipePlan::new(&layout(&[4; 3]), 32, |_| None);
        assert_eq!(plan.buckets, [0..2, 2..3]);
        assert_eq!(plan.order, [1, 0]);
        assert!(!plan.has_units);
    }

    #[test]
    fn a_bucket_goes_when_complete_in_plan_order_with_the_held_sum_and_factor() {
        let units = [Some(0), Some(1)];
        let plan = Arc::new(PipePlan::new(&layout(&[2, 2, 0]), 1 << 20, |id| {
            units.get((id.val() - 1) as usize).copied().flatten()
        }));
        let held = WindowStart {
            held: vec![Some(vec![1.0, 2.0]), None, None],
            factor: Some(0.5),
        };
        let comm = Comm::new(ProcessGroup::single());
        let mut averager = Averager::new(plan, held, MixedPrecision::No, comm);
        // Entry 0's bucket is second in order: it waits for entry 1's.
        averager
            .receive(Delivery::Grad {
                entry: 0,
                values: vec![3.0, 4.0],
            })
            .unwrap();
        assert!(averager.done.is_empty());
        averager.receive(Delivery::Absent { entry: 1 }).unwrap();
        let done = averager.finish().unwrap();
        // Entry 1 had no gradient anywhere: its bucket carries nothing; entry 2 is frozen.
        assert_eq!(done.len(), 2);
        assert!(done[0].entries.is_empty());
        assert_eq!(done[1].entries, [(0, 0..2)]);
        assert_eq!(done[1].values, [2.0, 3.0]);
    }

    #[test]
    fn a_second_gradient_for_one_parameter_is_an_error() {
        let plan = Arc::new(PipePlan::new(&layout(&[2, 2]), 1 << 20, |_| Some(0)));
        let comm = Comm::new(ProcessGroup::single());
        let mut averager = Averager::new(plan, start(), MixedPrecision::No, comm);
        let grad = || Delivery::Grad {
            entry: 0,
            values: vec![1.0, 1.0],
        };
        averager.receive(grad()).unwrap();
        let error = averager.receive(grad()).unwrap_err().to_string();
        assert!(error.contains("two gradients"), "{error}");
    }

    #[test]
    fn a_gradient_only_one_process_has_is_averaged_with_the_others_zeros() {
        let plan = Arc::new(PipePlan::new(&layout(&[2, 1]), 1 << 20, |_| None));
        let groups = ProcessGroup::local(2, &GroupOptions::default());
        let results: Vec<Vec<AveragedBucket>> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|group| {
                    let plan = Arc::clone(&plan);
                    s.spawn(move || {
                        let rank = group.rank();
                        let comm = Comm::new(group);
                        let mut run =
                            PipeRun::spawn(Averager::new(plan, start(), MixedPrecision::No, comm))
                                .unwrap();
                        // Only rank 1 has entry 1's gradient; both have entry 0's.
                        let second = match rank {
                            1 => Delivery::Grad {
                                entry: 1,
                                values: vec![8.0],
                            },
                            _ => Delivery::Absent { entry: 1 },
                        };
                        run.deliver(second).unwrap();
                        run.deliver(Delivery::Grad {
                            entry: 0,
                            values: vec![rank as f32, 2.0],
                        })
                        .unwrap();
                        run.finish(rank).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for done in &results {
            assert_eq!(done.len(), 1);
            assert_eq!(done[0].entries, [(0, 0..2), (1, 2..3)]);
            assert_eq!(done[0].values, [0.5, 2.0, 4.0]);
        }
    }
}
