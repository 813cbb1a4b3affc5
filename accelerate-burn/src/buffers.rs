//! Float state the forward pass updates without gradients (Burn's `RunningState`: BatchNorm's
//! running mean and variance), kept the same on every process: averaged over the processes at
//! every optimizer update (and every skipped fp16 step), so evaluation and checkpoints see
//! one set of statistics, bit-identical on every rank.
//!
//! Averaged, not broadcast from rank 0 (PyTorch DDP's default): the running mean's update is
//! linear, so with equal per-process batches the averaged running mean is the running mean a
//! single process would keep on the global batch; the averaged running variance is the mean
//! of the per-process batch variances (the spread between processes' batch means is left
//! out, as with DDP without SyncBatchNorm). Inside an accumulation window each process's
//! statistics move on its own batches; they agree again at the window's end, which is where
//! a loop evaluates and saves.
//!
//! Frozen parameters are float state without gradients too, but they never change and must
//! keep their exact values; they are told apart from running states at prepare by asking
//! every float parameter to require gradients on a clone of the model: a frozen parameter
//! does, a running state refuses (Burn's `RunningState` drops the request).

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;

use accelerate_core::comm::Reduction;

use crate::error::AccelerateError;
use crate::group::Comm;
use crate::params::{self, ParamLayout, ParamList, Replacement};

/// Which of a model's float parameters (visit order) are running states, and how to average
/// them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BufferSync {
    /// Visit-order indices of the running states, with their element counts.
    entries: Vec<(usize, usize)>,
}

/// Asks every float parameter to require gradients.
struct RequireGrad;

impl ModuleMapper for RequireGrad {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        Param::from_mapped_value(id, tensor.require_grad(), mapper)
    }
}

impl BufferSync {
    /// The running states of the prepared `model`, which must be on an autodiff device (as
    /// prepared models are); `None` when it has none.
    pub fn of<M: Module>(model: &M) -> Option<Self> {
        let before = ParamLayout::of(model);
        if before.entries.iter().all(|e| e.trainable) {
            return None;
        }
        // A running state's clone shares its value; mapping it stores the same values again,
        // without gradients, so the model itself is unchanged.
        let probed = model.clone().map(&mut RequireGrad);
        let after = ParamLayout::of(&probed);
        drop(probed);
        let entries: Vec<(usize, usize)> = before
            .entries
            .iter()
            .zip(&after.entries)
            .enumerate()
            .filter(|(_, (b, a))| !b.trainable && !a.trainable && b.numel > 0)
            .map(|(i, (b, _))| (i, b.numel))
            .collect();
        (!entries.is_empty()).then_some(Self { entries })
    }

    /// Elements of running state.
    pub fn numel(&self) -> usize {
        self.entries.iter().map(|(_, n)| n).sum()
    }

    /// `model` with its running states replaced by their average over the processes of
    /// `comm` (every process must call it at the same point).
    pub fn average<M: Module>(&self, model: M, comm: &Comm) -> Result<M, AccelerateError> {
        // A running state keeps its latest update apart until the next forward reads it;
        // `valid` folds it in (into the value the model shares), so the average includes it
        // and no pending update overwrites the average later.
        drop(model.valid());
        let values = params::values(&model);
        let mut flat = Vec::with_capacity(self.numel());
        let mut device = None;
        for &(i, _) in &self.entries {
            let Some(value) = values.get(i) else {
                return Err(AccelerateError::ModelMismatch {
                    rank: comm.rank(),
                    detail: format!(
                        "the model has {} float parameters, fewer than when it was prepared",
                        values.len()
                    ),
                });
            };
            device.get_or_insert_with(|| value.device());
            flat.extend(params::to_host_f32(value.clone()));
        }
        if flat.len() != self.numel() {
            return Err(AccelerateError::ModelMismatch {
                rank: comm.rank(),
                detail: "its running states (BatchNorm statistics) changed size since it was \
                         prepared"
                    .into(),
            });
        }
        comm.timed(|group| group.all_reduce(&mut flat, Reduction::Mean))?;
        let Some(device) = device else {
            return Ok(model);
        };
        let mut list: ParamList = vec![None; values.len()];
        let mut at = 0;
        for &(i, n) in &self.entries {
            list[i] = Some(params::upload(flat[at..at + n].to_vec(), &device));
            at += n;
        }
        Ok(params::replace(
            model,
            Replacement {
                values: list,
                ids: Vec::new(),
            },
        ))
    }
}
