//! The phases of a training step as `tracing` spans, for per-rank timelines
//! (`ACCELERATE_TRACE`, see `accelerate_core::trace`): `step` (from the end of one update to
//! the end of the next), `data_wait` (a prepared loader's `next`), `forward` (from the batch
//! to `backward`: the user's forward pass and loss), `backward` (with the gradient
//! collectives inside it), `optimizer`, `ema` (a moving average of the weights), `evaluation` (a pass over an evaluation loader), `checkpoint`. Without a subscriber every call here is a
//! check of a cached flag.
//!
//! The spans of a step outlive the calls that open them, so they are kept per thread: the
//! training loop's.

use std::cell::RefCell;

use tracing::Span;
use tracing::span::EnteredSpan;

thread_local! {
    /// The step under way on this thread.
    static STEP: RefCell<Option<Span>> = const { RefCell::new(None) };
    /// The forward pass under way (a batch was handed out, `backward` not yet called).
    static FORWARD: RefCell<Option<Span>> = const { RefCell::new(None) };
}

fn begin_step() {
    STEP.with(|step| {
        let mut step = step.borrow_mut();
        if step.is_none() {
            *step = Some(tracing::info_span!("step", update = tracing::field::Empty));
        }
    });
}

fn end_forward() {
    FORWARD.with(|forward| drop(forward.borrow_mut().take()));
}

/// Waiting for a prepared loader's batch (`role`: "train", "eval").
pub(crate) fn data_wait(role: &'static str) -> EnteredSpan {
    if role == "train" {
        begin_step();
        end_forward();
    }
    tracing::info_span!("data_wait", role).entered()
}

/// A training batch was handed to the loop: its forward pass begins.
pub(crate) fn batch_ready() {
    FORWARD.with(|forward| *forward.borrow_mut() = Some(tracing::info_span!("forward")));
}

/// `backward` (the end of the forward pass).
pub(crate) fn backward() -> EnteredSpan {
    begin_step();
    end_forward();
    tracing::info_span!("backward").entered()
}

/// The optimizer's update.
pub(crate) fn optimizer() -> EnteredSpan {
    end_forward();
    tracing::info_span!("optimizer").entered()
}

/// Update `update` is applied: its step ends and the next one begins.
pub(crate) fn step_done(update: u64) {
    STEP.with(|step| {
        let mut step = step.borrow_mut();
        if let Some(span) = step.take() {
            span.record("update", update);
        }
        *step = Some(tracing::info_span!("step", update = tracing::field::Empty));
    });
}

/// Updating a moving average of the weights (`ema_update`).
pub(crate) fn ema() -> EnteredSpan {
    tracing::info_span!("ema").entered()
}

/// A pass over an evaluation loader (its batches and what the loop does with them), kept by
/// the loader's iterator until it is dropped.
pub(crate) fn evaluation() -> Span {
    tracing::info_span!("evaluation")
}

/// Saving or loading a checkpoint (`action`: "save", "load").
pub(crate) fn checkpoint(action: &'static str) -> EnteredSpan {
    tracing::info_span!("checkpoint", action).entered()
}
