//! [`TapHub`]: what the taps of an accelerator's units share with its backward pass. The
//! accelerator arms it with a window's pipe before Burn's backward pass runs; each tap's
//! backward hands its parameter's gradient to the pipe's communication thread and goes on,
//! passing the gradient on to the parameter too, or (ZeRO-2, whose pipe reduces it into this
//! rank's shard) letting it go, so that Burn never holds every gradient at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use burn::module::ParamId;
use burn::tensor::TensorData;

use super::pipe::Delivery;
use super::throttle::Throttle;

/// The units of one accelerator and the window whose gradients their taps feed, if any.
pub(crate) struct TapHub {
    /// Taps are put in the graph: overlap on, several processes, a backend with the tap
    /// operation.
    enabled: bool,
    state: Mutex<HubState>,
    /// Gradients handed to a communication thread from inside backward, so far.
    handed: AtomicU64,
}

#[derive(Default)]
struct HubState {
    /// Each unit parameter's unit number.
    units: HashMap<ParamId, u64>,
    next_unit: u64,
    armed: Option<Armed>,
    /// The first tap that could not read its gradient in this backward pass.
    failure: Option<String>,
}

/// A window being averaged while backward runs.
struct Armed {
    /// Layout entry of each parameter the pipe averages.
    entries: Arc<HashMap<ParamId, usize>>,
    /// Entries handed in by a tap.
    delivered: Vec<bool>,
    sender: Sender<Delivery>,
    /// ZeRO-2: the taps let their gradients go (they pass them on to the parameters without
    /// one), counting them here, and the units' anchors hold backward on it.
    throttle: Option<Arc<Throttle>>,
}

/// What a tap does with its parameter's gradient in this backward pass.
pub(crate) enum TapClaim {
    /// Nothing to hand over (not armed, or not a parameter the pipe averages): pass it on.
    Pass,
    /// Hand a copy to the pipe and pass it on to the parameter.
    Copy(Handover),
    /// Hand it to the pipe and let it go (the parameter gets no gradient from Burn).
    Take(Handover),
}

/// Where one claimed gradient goes.
pub(crate) struct Handover {
    entry: usize,
    sender: Sender<Delivery>,
    throttle: Option<Arc<Throttle>>,
}

/// What a tap carries: where its gradient goes (shared, cheap to clone).
#[derive(Clone)]
pub(crate) struct TapSpec {
    pub hub: Arc<TapHub>,
    pub id: ParamId,
}

impl std::fmt::Debug for TapSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TapSpec").field("id", &self.id).finish()
    }
}

impl TapHub {
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            state: Mutex::new(HubState::default()),
            handed: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gradients the taps handed to a communication thread so far.
    pub fn handed(&self) -> u64 {
        self.handed.load(Ordering::Relaxed)
    }

    /// Whether units put taps in the graph.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Files `ids` as the parameters of a new unit.
    pub fn register_unit(&self, ids: impl IntoIterator<Item = ParamId>) {
        let mut state = self.lock();
        let unit = state.next_unit;
        state.next_unit += 1;
        for id in ids {
            state.units.insert(id, unit);
        }
    }

    /// The unit of parameter `id`, if it belongs to one.
    pub fn unit_of(&self, id: ParamId) -> Option<u64> {
        self.lock().units.get(&id).copied()
    }

    /// Sends the taps' gradients of the parameters in `entries` to `sender` until
    /// [`disarm`](Self::disarm); `delivered` starts with the entries handed in already.
    /// Without a `throttle` the taps also pass each gradient on to its parameter; with one
    /// they let it go, and the units' anchors hold backward on the throttle.
    pub fn arm(
        &self,
        entries: Arc<HashMap<ParamId, usize>>,
        delivered: Vec<bool>,
        sender: Sender<Delivery>,
        throttle: Option<Arc<Throttle>>,
    ) {
        let mut state = self.lock();
        state.failure = None;
        state.armed = Some(Armed {
            entries,
            delivered,
            sender,
            throttle,
        });
    }

    /// Stops sending; returns which entries the taps handed in (none when not armed) and the
    /// first failure to read a gradient.
    pub fn disarm(&self) -> (Vec<bool>, Option<String>) {
        let mut state = self.lock();
        let delivered = state.armed.take().map(|a| a.delivered).unwrap_or_default();
        (delivered, state.failure.take())
    }

    /// A tap's backward: what to do with parameter `id`'s gradient (hand it to the armed
    /// window, if it averages that parameter, and whether to pass it on too).
    pub fn claim(&self, id: ParamId) -> TapClaim {
        let mut state = self.lock();
        let Some(armed) = state.armed.as_mut() else {
            return TapClaim::Pass;
        };
        let Some(&entry) = armed.entries.get(&id) else {
            return TapClaim::Pass;
        };
        let first = armed.delivered.get(entry).is_some_and(|done| !done);
        if let Some(done) = armed.delivered.get_mut(entry) {
            *done = true;
        }
        if !first {
            // A second gradient for the entry: the pipe reports the misuse.
            let _ = armed.sender.send(Delivery::Absent { entry });
            return TapClaim::Pass;
        }
        let handover = Handover {
            entry,
            sender: armed.sender.clone(),
            throttle: armed.throttle.clone(),
        };
        if handover.throttle.is_some() {
            TapClaim::Take(handover)
        } else {
            TapClaim::Copy(handover)
        }
    }

    /// A unit's anchor in backward (the unit's gradients handed over, the operations before
    /// it not yet run): waits on the armed window's throttle, if any.
    pub fn gate(&self) {
        let throttle = self
            .lock()
            .armed
            .as_ref()
            .and_then(|armed| armed.throttle.clone());
        if let Some(throttle) = throttle {
            throttle.gate();
        }
    }

    /// Hands a claimed gradient to the pipe; `read` gives its values on the host.
    pub fn hand_over(
        &self,
        handover: Handover,
        read: impl FnOnce() -> Result<TensorData, TapReadError>,
    ) {
        let Handover {
            entry,
            sender,
            throttle,
        } = handover;
        // A half-precision gradient (a unit under autocast taps its parameters' casts) widens
        // exactly: the f32 master's gradient, which the cast's backward makes the same way. An
        // f32 one the tap let go hands its buffer over uncopied.
        let values = read().and_then(|data| {
            crate::params::into_f32_vec(data).map_err(|e| TapReadError::Backend(format!("{e:?}")))
        });
        let (delivery, bytes) = match values {
            Ok(values) => {
                let bytes = values.len() * size_of::<f32>();
                let tapped = throttle.is_some();
                (
                    Delivery::Grad {
                        entry,
                        values,
                        tapped,
                    },
                    bytes,
                )
            }
            Err(e) => return self.fail(&e, entry, &sender),
        };
        if sender.send(delivery).is_ok() {
            self.handed.fetch_add(1, Ordering::Relaxed);
            if let Some(throttle) = throttle {
                throttle.handed(bytes);
            }
        }
    }

    /// Records a gradient the tap could not read; its entry takes part as absent so that no
    /// peer waits for this process, and backward fails with the cause.
    fn fail(&self, cause: &TapReadError, entry: usize, sender: &Sender<Delivery>) {
        let _ = sender.send(Delivery::Absent { entry });
        let mut state = self.lock();
        state
            .failure
            .get_or_insert(format!("reading a unit's gradient failed: {cause}"));
    }
}

/// Why a tap could not read its parameter's gradient.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TapReadError {
    /// The backend failed to read the tensor (its message).
    #[error("the backend could not read the gradient: {0}")]
    Backend(String),
    /// The backend cannot read a tensor without blocking on an async runtime.
    #[error("this platform cannot read a tensor synchronously")]
    NotSynchronous,
}
