//! What every gradient reducer implements ([`GradientReducer`]) and the values it exchanges
//! with the accelerator, the prepared optimizer and checkpoints: the outcome of a window, the
//! model it steps, the files it saves and what it loads from.

use std::path::Path;
use std::sync::Arc;

use accelerate_core::checkpoint::ManifestFile;
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;

use crate::error::AccelerateError;
use crate::fused::HeldBytes;
use crate::group::Comm;
use crate::params::{ParamLayout, ParamList, ParamUpdate};
use crate::reducer::flat::{FusedStateFile, Segment, ShardSink};
use crate::stage_error::StageError;

/// The payload of [`Gradients`](super::Gradients).
#[derive(Debug)]
pub(crate) enum Outcome {
    NotDue,
    Skipped,
    /// Averaged, unscaled gradients in layout order, with their layout.
    Ready {
        grads: ParamList,
        layout: Arc<ParamLayout>,
        /// Their global L2 norm when it is not theirs alone (ZeRO-3: each rank holds its
        /// shards' gradients, the norm is over every rank's); `None`: computed from `grads`.
        norm: Option<f32>,
    },
    /// Held by the reducer; the global L2 norm (before clipping) and the clipping factor the
    /// step will apply.
    Held {
        norm: HeldNorm,
        clip_factor: f32,
    },
}

/// The global L2 norm of gradients a reducer holds: measured while averaging, or left on the
/// device until clipping asks for it. Reading a device value waits for every queued kernel, so
/// a step that never clips (and is not fp16, whose overflow test needs the value) queues its
/// whole update without stopping the device's stream.
#[derive(Debug)]
pub(crate) enum HeldNorm {
    /// Measured.
    Known(f32),
    /// Not measured yet: the averaged gradients (sharing the reducer's buffers, not copies)
    /// and the fp16 unscale factor; the norm is `sqrt(sum of squares) * unscale`.
    OnDevice { grads: Vec<Tensor<1>>, unscale: f32 },
}

impl HeldNorm {
    /// The norm, read from the device on the first call.
    pub fn value(&mut self) -> f32 {
        let norm = match self {
            Self::Known(norm) => return *norm,
            Self::OnDevice { grads, unscale } => {
                unscaled_norm(sum_of_squares_on_device(grads), *unscale)
            }
        };
        *self = Self::Known(norm);
        norm
    }
}

/// The L2 norm of gradients whose squares sum to `sum_sq`, times fp16's `unscale` (1 without
/// loss scaling), computed in f64.
pub(crate) fn unscaled_norm(sum_sq: f64, unscale: f32) -> f32 {
    (sum_sq.sqrt() * f64::from(unscale)) as f32
}

/// The sum of squares of a window's averaged gradients, as the buffers measured it.
pub(crate) enum SumOfSquares {
    /// Read (on the host, or from the device).
    Measured(f64),
    /// Left on the device: the averaged gradients (one flat tensor or one per segment), to be
    /// measured when someone asks.
    #[cfg_attr(not(feature = "device-kernels"), allow(dead_code))]
    Deferred(Vec<Tensor<1>>),
}

/// The sum of the squares of every value of `parts`, as a one-value tensor on the device;
/// `None` when there are no parts.
fn squares_summed<'a>(parts: impl Iterator<Item = &'a Tensor<1>>) -> Option<Tensor<1>> {
    parts
        .map(|part| part.clone().square().sum())
        .reduce(|total, sum| total + sum)
}

/// The sum of the squares of every value of `parts`, summed on the device: one 4-byte read.
pub(crate) fn sum_of_squares_on_device(parts: &[Tensor<1>]) -> f64 {
    squares_summed(parts.iter()).map_or(0.0, |total| f64::from(total.into_scalar::<f32>()))
}

/// The L2 norm over every gradient of `grads`, computed on the device; `None` when empty.
pub(crate) fn global_norm(grads: &ParamList) -> Option<f32> {
    Some(
        squares_summed(grads.iter().flatten())?
            .sqrt()
            .into_scalar::<f32>(),
    )
}

/// What a reducer made of a completed window.
pub(crate) struct Reduced {
    /// [`Outcome::Ready`] or [`Outcome::Held`].
    pub outcome: Outcome,
    /// True when a gradient of any rank is not finite (fp16 overflow: the step is skipped).
    pub overflow: bool,
}

/// Who writes a reducer's files in a checkpoint.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SaveRole {
    pub rank: usize,
    pub main: bool,
    pub distributed: bool,
}

/// One file of a checkpoint, serialised (the checkpoint writes it: at once, or in the
/// background for an asynchronous save).
pub(crate) struct SavedFile {
    /// Its name in the checkpoint directory (`sub/name` inside a directory of its own).
    pub name: String,
    /// What it holds, as the manifest says.
    pub contents: &'static str,
    /// The rank that wrote it, for files of one rank.
    pub rank: Option<usize>,
    /// Its bytes.
    pub data: Vec<u8>,
}

/// What a reducer gets back from a checkpoint.
pub(crate) struct LoadSource<'a> {
    pub dir: &'a Path,
    /// Every file of the checkpoint.
    pub files: &'a [ManifestFile],
    /// The loaded model's parameters (visit order, flattened) and its layout.
    pub values: Vec<Tensor<1>>,
    pub layout: ParamLayout,
}

/// What a reducer may do to the model in its step. Implemented once for every module type
/// by [`ModelCell`], so that reducers stay object-safe.
pub(crate) trait ModelUpdate {
    /// Burn's optimizer steps the model with `grads`.
    fn burn_step(
        &mut self,
        optim: &mut ModuleOptimizer,
        lr: ModuleLearningRate,
        grads: GradientsParams,
    );
    /// The parameters take new values (visit order; `None` keeps one).
    fn replace(&mut self, values: ParamList);
    /// The parameters `update` updates take new values computed from their current ones,
    /// one parameter at a time.
    fn update_each(&mut self, update: &mut dyn ParamUpdate);
}

/// Which reducer a prepared optimizer has. Its name is what checkpoints record: a checkpoint
/// loads only into a reducer of its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReducerKind {
    /// Burn's optimizer, its gradients averaged in buckets (`burn`).
    Burn,
    /// Our fused optimizer over flat buffers (`fused`).
    Fused,
}

impl ReducerKind {
    /// The name checkpoints record.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Burn => "burn",
            Self::Fused => "fused",
        }
    }
}

impl std::fmt::Display for ReducerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One gradient reducer: averaging, update and state of one prepared model and optimizer.
pub(crate) trait GradientReducer: Send {
    /// The kind, recorded in checkpoints.
    fn kind(&self) -> ReducerKind;

    /// The parameters it was built for.
    fn layout(&self) -> &Arc<ParamLayout>;

    /// Averages a completed window's summed gradients (layout order) over the processes of
    /// `comm` and, given `inv_scale` (fp16), unscales them and says whether any is not finite.
    fn reduce(
        &mut self,
        grads: ParamList,
        comm: &Comm,
        inv_scale: Option<f32>,
    ) -> Result<Reduced, AccelerateError>;

    /// True when the reducer can take gradients the accelerator's pipe already averaged on
    /// the host (`reduce` then gets them with a group of one): Burn's optimizers averaging on
    /// the host, and fused optimizers with whole host buffers (ZeRO-0).
    fn takes_averaged(&self) -> bool {
        false
    }

    /// True when the reducer averages each micro-batch as it comes and holds the open
    /// window's sum itself (ZeRO-2 holds it as this rank's shard): `backward` then hands it
    /// every micro-batch through [`accumulate`](Self::accumulate) and, at the window's end,
    /// calls `reduce` with no gradients.
    fn holds_window_sum(&self) -> bool {
        false
    }

    /// Averages one micro-batch's gradients (layout order) into the held window sum;
    /// `first` starts a new window. Only called when [`holds_window_sum`](Self::holds_window_sum).
    fn accumulate(
        &mut self,
        _grads: ParamList,
        _first: bool,
        comm: &Comm,
    ) -> Result<(), AccelerateError> {
        Err(AccelerateError::UnexpectedGradients { rank: comm.rank() })
    }

    /// ZeRO-2 over units' taps: lends this rank's shard of the window's sum to the gradient
    /// pipe for one micro-batch's backward pass (`first`: the window's first), which reduces
    /// each bucket into it as the taps hand the bucket's gradients over; `None` where the
    /// reducer holds no sharded sum.
    fn lend_shard(&mut self, _first: bool, _comm: &Comm) -> Option<ShardSink> {
        None
    }

    /// Takes back the shard [`lend_shard`](Self::lend_shard) lent, with the micro-batch in it.
    fn return_shard(&mut self, _sink: ShardSink) {}

    /// Multiplies the held window sum by `factor` (a window of summed losses, weighted by
    /// its items).
    fn scale_held(&mut self, _factor: f64) {}

    /// Forgets what `reduce` held (the step was skipped).
    fn discard(&mut self) {}

    /// Applies the update for `outcome` (what `reduce` returned, possibly clipped) to `model`.
    fn step(
        &mut self,
        lr: ModuleLearningRate,
        outcome: Outcome,
        model: &mut dyn ModelUpdate,
        comm: &Comm,
    ) -> Result<(), AccelerateError>;

    /// This rank's part of the optimizer state, serialised (no file is written here: the
    /// checkpoint writes them, possibly on its background thread).
    fn save(&mut self, role: SaveRole) -> Result<Vec<SavedFile>, StageError>;

    /// Continues from a checkpoint: optimizer state, and the loaded model's parameters.
    fn load(&mut self, source: LoadSource<'_>) -> Result<(), StageError>;

    /// As [`load`](Self::load), with the fused optimizer state that `state` makes for the
    /// rebuilt buffers' segments (ZeRO-3 puts it together from shards of another world
    /// size). Only the fused reducer keeps such state.
    fn load_resharded(
        &mut self,
        _source: LoadSource<'_>,
        _state: &mut dyn FnMut(&[Segment]) -> Result<FusedStateFile, StageError>,
    ) -> Result<(), StageError> {
        Err(StageError::from(AccelerateError::Misuse {
            rank: 0,
            what: "a resharded optimizer state for Burn's optimizer".into(),
            hint: "checkpoints of sharded units (ZeRO-3) hold the fused optimizer's state: \
                   prepare a fused optimizer",
        }))
    }

    /// Where the optimizer state lives: `Some(true)` on the GPU. `None` when the reducer does
    /// not hold the state itself.
    fn state_on_device(&self) -> Option<bool> {
        None
    }

    /// What this process's buffers hold between steps (`None` when the reducer does not
    /// hold the optimizer's buffers itself).
    fn held_bytes(&self) -> Option<HeldBytes> {
        None
    }

    /// For a model with sharded units (ZeRO-3), per parameter (layout order) the whole
    /// parameter's elements of a shard, `None` for a parameter left whole.
    fn shard_numels(&self) -> Option<&[Option<usize>]> {
        None
    }

    /// Burn's optimizer, when the reducer steps with one.
    fn burn_optimizer(&self) -> Option<&ModuleOptimizer> {
        None
    }

    /// Burn's optimizer, mutably.
    fn burn_optimizer_mut(&mut self) -> Option<&mut ModuleOptimizer> {
        None
    }
}
