//! The gradient pipe: one window's gradients, handed in parameter by parameter as they become
//! final, averaged over the processes bucket by bucket: all-reduced for the reducer to take,
//! or under ZeRO-2 reduce-scattered into this rank's shard of the window's sum
//! ([`BucketSink`]). The same [`Averager`] runs on the caller's thread (gradients handed in
//! after backward) or on a communication thread that the units' taps feed during backward:
//! the buckets, their order and every addition are the same, so the two give the same bits.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;

use accelerate_core::MixedPrecision;
use burn::module::ParamId;

use super::throttle::Throttle;
use crate::error::AccelerateError;
use crate::group::Comm;
use crate::params::ParamLayout;
use crate::reducer::wire::Wire;
use crate::reducer::{BucketGrad, ShardSink};

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
    /// Its values (f32, flattened); `tapped`: a tap let it go and counted it on the
    /// pipe's throttle.
    Grad {
        entry: usize,
        values: Vec<f32>,
        tapped: bool,
    },
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

/// Where each complete bucket goes.
pub(crate) enum BucketSink {
    /// All-reduced (mean) over the job and kept for the reducer to take (ZeRO 0 and 1,
    /// Burn's optimizers).
    Averaged {
        wire: Wire,
        comm: Comm,
        done: Vec<AveragedBucket>,
    },
    /// ZeRO-2: reduce-scattered into this rank's shard of the window's sum, and let go.
    Shard(Box<ShardSink>),
}

impl BucketSink {
    /// The averaged buckets (an error where the buckets went into a shard).
    pub fn into_averaged(self, rank: usize) -> Result<Vec<AveragedBucket>, AccelerateError> {
        match self {
            Self::Averaged { done, .. } => Ok(done),
            Self::Shard(_) => Err(AccelerateError::UnexpectedGradients { rank }),
        }
    }

    /// The shard the buckets went into (an error where they were averaged whole).
    pub fn into_shard(self, rank: usize) -> Result<ShardSink, AccelerateError> {
        match self {
            Self::Shard(sink) => Ok(*sink),
            Self::Averaged { .. } => Err(AccelerateError::UnexpectedGradients { rank }),
        }
    }
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
    /// Per entry: handed over by a tap that counted it on `throttle`.
    tapped: Vec<bool>,
    /// Gradients received from such taps.
    tapped_received: u64,
    /// How far the taps may run ahead (ZeRO-2's taps, which let their gradients go).
    throttle: Option<Arc<Throttle>>,
    /// The rank errors name.
    rank: usize,
    sink: BucketSink,
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
    /// Buckets all-reduced over `comm`, travelling in `wire`'s precision.
    pub fn new(plan: Arc<PipePlan>, start: WindowStart, wire: MixedPrecision, comm: Comm) -> Self {
        let rank = comm.rank();
        let sink = BucketSink::Averaged {
            wire: Wire::new(wire),
            comm,
            done: Vec::new(),
        };
        Self::with_sink(plan, start, rank, sink)
    }

    /// ZeRO-2: buckets reduce-scattered into `sink`, this rank's shard of the window's sum
    /// (each micro-batch communicates; no earlier sum or factor to apply here).
    /// The taps wait on `throttle` when this averager falls behind them.
    pub fn into_shard(plan: Arc<PipePlan>, sink: ShardSink, throttle: Arc<Throttle>) -> Self {
        let start = WindowStart {
            held: Vec::new(),
            factor: None,
        };
        let rank = sink.rank();
        let mut averager = Self::with_sink(plan, start, rank, BucketSink::Shard(Box::new(sink)));
        averager.throttle = Some(throttle);
        averager
    }

    fn with_sink(plan: Arc<PipePlan>, start: WindowStart, rank: usize, sink: BucketSink) -> Self {
        let mut waiting: Vec<usize> = plan.buckets.iter().map(Range::len).collect();
        let plan_len = plan.len();
        let mut slots = vec![None; plan_len];
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
            tapped: vec![false; plan_len],
            tapped_received: 0,
            throttle: None,
            rank,
            sink,
            fault_at: None,
        }
    }

    /// Takes one entry's gradient and sends every bucket that is now due.
    pub fn receive(&mut self, delivery: Delivery) -> Result<(), AccelerateError> {
        let (entry, grad) = match delivery {
            Delivery::Grad {
                entry,
                values,
                tapped,
            } => {
                if tapped {
                    self.tapped_received += 1;
                    if let Some(slot) = self.tapped.get_mut(entry) {
                        *slot = true;
                    }
                }
                (entry, Some(values))
            }
            Delivery::Absent { entry } => (entry, None),
        };
        let rank = self.rank;
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
    /// entry (zeros where this process has no gradient), so the lengths match on every
    /// process whatever each one's backward reached, and an entry any process had a gradient
    /// for is averaged with the others' zeros, as one process over the global batch would see
    /// it. All-reduced, it carries after them one flag per entry (1 where this process has a
    /// gradient), so that one no process had stays without a gradient; reduce-scattered, the
    /// reducer agrees on that once per window.
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
            if let Some(at) = self.fault_at {
                let sent = SENT_ON_THREADS.fetch_add(1, Ordering::Relaxed) + 1;
                if sent == at {
                    eprintln!("{FAULT_AT}: aborting before bucket {sent}");
                    std::process::abort();
                }
            }
            // The bucket's gradients (`None` where this process has none), each with the
            // bytes a tap counted on the throttle for it.
            let mut grads = Vec::with_capacity(trained.len());
            for &entry in &trained {
                let numel = self.plan.numel[entry];
                let counted = std::mem::take(&mut self.tapped[entry]);
                let grad = self.slots[entry]
                    .replace(None)
                    .flatten()
                    .filter(|grad| grad.len() == numel);
                let counted = if counted { numel * size_of::<f32>() } else { 0 };
                grads.push(BucketGrad {
                    entry,
                    grad,
                    counted,
                });
            }
            let (wire, comm, done) = match &mut self.sink {
                BucketSink::Shard(sink) => {
                    let throttle = self.throttle.as_deref();
                    sink.reduce(grads, throttle)?;
                    continue;
                }
                BucketSink::Averaged { wire, comm, done } => (wire, comm, done),
            };
            let len: usize = trained.iter().map(|&e| self.plan.numel[e]).sum();
            let mut values = Vec::with_capacity(len + trained.len());
            let mut had = Vec::with_capacity(trained.len());
            for bucket_grad in grads {
                let numel = self.plan.numel[bucket_grad.entry];
                // Each gradient is let go as soon as it is in the bucket.
                match bucket_grad.grad {
                    Some(grad) => {
                        values.extend_from_slice(&grad);
                        had.push(true);
                    }
                    None => {
                        values.resize(values.len() + numel, 0.0);
                        had.push(false);
                    }
                }
            }
            values.extend(had.iter().map(|&has| if has { 1.0 } else { 0.0 }));
            comm.timed(|group| wire.all_reduce_mean(&mut values, group))?;
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
            done.push(AveragedBucket { entries, values });
        }
        Ok(())
    }

    /// Where the buckets went (the averaged ones, or the shard), once every entry was handed
    /// in.
    fn finish(self) -> Result<BucketSink, AccelerateError> {
        if self.next < self.plan.order.len() {
            return Err(AccelerateError::UnexpectedGradients { rank: self.rank });
        }
        Ok(self.sink)
    }
}

/// Where the [`Averager`] of a window runs.
pub(crate) enum PipeRun {
    /// On the caller's thread, as gradients are handed in.
    Inline(Box<Averager>),
    /// On a communication thread fed by a channel (the taps hold clones of the sender).
    Thread {
        sender: Sender<Delivery>,
        thread: JoinHandle<Result<BucketSink, AccelerateError>>,
    },
}

impl PipeRun {
    /// The averager on a thread of its own.
    pub fn spawn(mut averager: Averager) -> Result<Self, AccelerateError> {
        let (sender, receiver) = channel();
        let rank = averager.rank;
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

    /// Waits for every bucket and returns where they went.
    pub fn finish(self, rank: usize) -> Result<BucketSink, AccelerateError> {
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
) -> Result<BucketSink, AccelerateError> {
    let throttle = averager.throttle.clone();
    let result = (|| {
        loop {
            let delivery = match receiver.try_recv() {
                Ok(delivery) => delivery,
                Err(TryRecvError::Empty) => {
                    // Nothing to send until more gradients come: no gate waits for this thread.
                    if let Some(throttle) = &throttle {
                        throttle.stall(Some(averager.tapped_received));
                    }
                    let next = receiver.recv();
                    if let Some(throttle) = &throttle {
                        throttle.stall(None);
                    }
                    match next {
                        Ok(delivery) => delivery,
                        Err(_) => break,
                    }
                }
                Err(TryRecvError::Disconnected) => break,
            };
            averager.receive(delivery)?;
        }
        averager.finish()
    })();
    // No tap waits for a thread that stopped.
    if let Some(throttle) = throttle {
        throttle.close();
    }
    result
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
                tapped: false,
            })
            .unwrap();
        assert!(matches!(&averager.sink, BucketSink::Averaged { done, .. } if done.is_empty()));
        averager.receive(Delivery::Absent { entry: 1 }).unwrap();
        let done = averager.finish().unwrap().into_averaged(0).unwrap();
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
            tapped: false,
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
                                tapped: false,
                            },
                            _ => Delivery::Absent { entry: 1 },
                        };
                        run.deliver(second).unwrap();
                        run.deliver(Delivery::Grad {
                            entry: 0,
                            values: vec![rank as f32, 2.0],
                            tapped: false,
                        })
                        .unwrap();
                        run.finish(rank).unwrap().into_averaged(rank).unwrap()
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
