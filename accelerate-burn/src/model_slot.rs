//! [`ModelSlot`]: one owner per prepared model. Its accumulation windows and its gradient
//! reducer sit behind one lock, so `backward`, the prepared optimizer's `step` and checkpoints
//! see them change together, and no index links two lists. The prepared optimizer holds its
//! model's slot; [`ModelSlots`] finds a slot from a model (by its first parameter's id, one
//! map lookup) for `backward`, and answers the accelerator's loop-wide questions (the first
//! prepared model's updates, the latest backward pass's window).
//!
//! Locks: the table's lock is taken only to look a slot up or to register one, and never
//! together with a slot's lock. A slot's lock is held while its own reducer runs, collectives
//! included (the reducer is their caller); nothing loop-wide waits on it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use accelerate_core::DynamicLossScaler;
use burn::module::ParamId;

use crate::reducer::GradientReducer;
use crate::training_loop::{LoopClock, ModelWindows};

/// What a slot holds: its model's windows and reducer.
pub(crate) struct SlotState {
    /// The model's accumulation windows, loss scale and update count.
    pub windows: ModelWindows,
    /// Averages the model's gradients and applies its optimizer.
    pub reducer: Box<dyn GradientReducer>,
    /// Tells reducers apart: gradients carry it, so a window's gradients cannot reach another
    /// reducer's step (a new one gets a new id).
    pub reducer_id: u64,
    /// True once an optimizer was prepared for the model; false for the reducer `backward`
    /// made for a model whose optimizer is the user's own.
    pub prepared: bool,
}

impl SlotState {
    /// Replaces the reducer (an optimizer prepared for a model `backward` already served);
    /// the windows go on.
    pub fn install(&mut self, reducer: Box<dyn GradientReducer>) {
        self.reducer = reducer;
        self.reducer_id = next_reducer_id();
        self.prepared = true;
    }
}

/// The id of the model's first float parameter, as `reducer`'s layout has it (what the table
/// files a model under; loading a checkpoint gives the model the saved ids).
fn first_param(reducer: &dyn GradientReducer) -> Option<ParamId> {
    reducer.layout().entries.first().map(|e| e.id)
}

fn next_reducer_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// One prepared model's state; cloned handles share it.
#[derive(Clone)]
pub(crate) struct ModelSlot(Arc<Mutex<SlotState>>);

impl ModelSlot {
    /// Locks the slot. Every method of what it holds leaves it consistent (reducers check
    /// their buffers at each step), so a poisoned lock is still used.
    pub fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The prepared models of one accelerator, and what a new one starts from. Cloned handles
/// share them.
#[derive(Clone)]
pub(crate) struct ModelSlots {
    table: Arc<Mutex<SlotTable>>,
    clock: LoopClock,
    accumulation_steps: usize,
    /// The fp16 scaler each new model starts from.
    scaler: Option<DynamicLossScaler>,
}

#[derive(Default)]
struct SlotTable {
    /// Slots by the id of their model's first float parameter.
    by_first_param: HashMap<Option<ParamId>, ModelSlot>,
    /// The first model registered: its updates are the accelerator's, its windows drive
    /// the random stream.
    first: Option<ModelSlot>,
    /// The model of the latest backward pass.
    latest: Option<ModelSlot>,
}

impl ModelSlots {
    pub fn new(
        clock: LoopClock,
        accumulation_steps: usize,
        scaler: Option<DynamicLossScaler>,
    ) -> Self {
        Self {
            table: Arc::default(),
            clock,
            accumulation_steps,
            scaler,
        }
    }

    fn table(&self) -> MutexGuard<'_, SlotTable> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The slot of the model whose first float parameter is `first`.
    pub fn find(&self, first: Option<ParamId>) -> Option<ModelSlot> {
        self.table().by_first_param.get(&first).cloned()
    }

    /// The only slot, when there is exactly one.
    pub fn only(&self) -> Option<ModelSlot> {
        let table = self.table();
        match table.by_first_param.len() {
            1 => table.by_first_param.values().next().cloned(),
            _ => None,
        }
    }

    /// Registers a new model with `reducer` (the first model registered drives the random
    /// stream). A model already registered under the same first parameter keeps its slot:
    /// the error hands it back with `reducer`, unused.
    pub fn register(
        &self,
        reducer: Box<dyn GradientReducer>,
        prepared: bool,
    ) -> Result<ModelSlot, Registered> {
        let first_param = first_param(reducer.as_ref());
        let mut table = self.table();
        if let Some(existing) = table.by_first_param.get(&first_param) {
            return Err(Registered {
                slot: existing.clone(),
                reducer,
            });
        }
        let slot = ModelSlot(Arc::new(Mutex::new(SlotState {
            windows: ModelWindows::new(
                self.accumulation_steps,
                self.scaler.clone(),
                self.clock.clone(),
                table.first.is_none(),
            ),
            reducer,
            reducer_id: next_reducer_id(),
            prepared,
        })));
        table.first.get_or_insert_with(|| slot.clone());
        table.by_first_param.insert(first_param, slot.clone());
        Ok(slot)
    }

    /// Records `slot` as the model of the latest backward pass.
    pub fn set_latest(&self, slot: &ModelSlot) {
        self.table().latest = Some(slot.clone());
    }

    /// The first registered model's slot.
    pub fn first(&self) -> Option<ModelSlot> {
        self.table().first.clone()
    }

    /// The first model's loss scale, or, before any model, the one every model starts from
    /// (`None` without fp16).
    pub fn loss_scale(&self) -> Option<f32> {
        match self.first() {
            Some(slot) => slot.lock().windows.loss_scale(),
            None => self.scaler.as_ref().map(DynamicLossScaler::scale),
        }
    }

    /// Updates the first model applied so far (0 before any model).
    pub fn updates(&self) -> u64 {
        self.first().map_or(0, |slot| slot.lock().windows.updates())
    }

    /// The slot of the latest backward pass's model.
    pub fn latest(&self) -> Option<ModelSlot> {
        self.table().latest.clone()
    }

    /// Micro-batches summed in the open windows (the most of any model).
    pub fn pending(&self) -> usize {
        let slots: Vec<ModelSlot> = self.table().by_first_param.values().cloned().collect();
        slots
            .iter()
            .map(|slot| slot.lock().windows.pending())
            .max()
            .unwrap_or(0)
    }

    /// Micro-batches per update.
    pub fn accumulation_steps(&self) -> usize {
        self.accumulation_steps
    }

    /// Files `slot` under its model's first parameter as its reducer now has it (after a
    /// checkpoint load gave the parameters the saved ids).
    pub fn refile(&self, slot: &ModelSlot) {
        let first_param = first_param(slot.lock().reducer.as_ref());
        let mut table = self.table();
        table.by_first_param.retain(|_, s| !s.same(slot));
        table.by_first_param.insert(first_param, slot.clone());
    }
}

/// A model that already has a slot ([`ModelSlots::register`]).
pub(crate) struct Registered {
    /// Its slot.
    pub slot: ModelSlot,
    /// The reducer that was not registered.
    pub reducer: Box<dyn GradientReducer>,
}
