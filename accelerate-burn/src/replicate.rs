//! Every process starts from rank 0's model: each rank checks that it built the same model
//! (float parameter shapes, in visit order), then takes rank 0's parameter values and ids, so
//! that optimizer records and checkpoints line up too. Shards of sharded units (ZeRO-3) differ
//! between ranks by design and keep their values.

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::Tensor;

use crate::error::AccelerateError;
use crate::group::Comm;
use crate::params::{self, ParamLayout};

/// `model` with rank 0's parameter values and ids, except the parameters `is_shard` names. A
/// model that differs from rank 0's is an error on every rank (each names what differs, or
/// which ranks did).
pub(crate) fn from_rank0<M: Module>(
    model: M,
    comm: &Comm,
    is_shard: impl Fn(ParamId) -> bool,
) -> Result<M, AccelerateError> {
    let rank = comm.rank();
    let layout = ParamLayout::of(&model);
    let shapes = layout.shapes();
    let mut group = comm.lock();
    let rank0_shapes: Vec<Vec<usize>> = group.broadcast_object(Some(&shapes), 0)?;
    let difference = describe_difference(&shapes, &rank0_shapes);
    let mut differs = vec![0.0_f32; group.world_size()];
    group.all_gather(&[f32::from(u8::from(difference.is_some()))], &mut differs)?;
    let bad: Vec<String> = differs
        .iter()
        .enumerate()
        .filter(|(_, d)| **d != 0.0)
        .map(|(r, _)| r.to_string())
        .collect();
    if !bad.is_empty() {
        let detail = difference.unwrap_or_else(|| {
            format!(
                "ranks {} built a different model than rank 0",
                bad.join(", ")
            )
        });
        return Err(AccelerateError::ModelMismatch { rank, detail });
    }

    let ids: Vec<u64> = group.broadcast_object(Some(&layout.ids()), 0)?;
    drop(group);
    // One parameter at a time, so that no rank holds a second copy of the model. Shard
    // parameters have rank 0's ids already (they were cut from rank 0's unit) and keep their
    // values.
    let mut broadcast = Broadcast {
        comm,
        is_shard: &is_shard,
        ids: ids.into_iter(),
        failed: None,
    };
    let model = model.map(&mut broadcast);
    match broadcast.failed {
        Some(error) => Err(error),
        None => Ok(model),
    }
}

/// Gives each float parameter rank 0's value and id.
struct Broadcast<'a, F> {
    comm: &'a Comm,
    is_shard: &'a F,
    ids: std::vec::IntoIter<u64>,
    failed: Option<AccelerateError>,
}

impl<F: Fn(ParamId) -> bool> ModuleMapper for Broadcast<'_, F> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let id = self.ids.next().map(ParamId::from);
        if (self.is_shard)(param.id) || self.failed.is_some() {
            return params::with_value_id(param, id);
        }
        let numel = param.lazy_shape().num_elements();
        let mut flat = if self.comm.rank() == 0 {
            params::to_host_f32(param.val().reshape([numel]))
        } else {
            vec![0.0; numel]
        };
        if let Err(e) = self.comm.lock().broadcast(&mut flat, 0) {
            self.failed = Some(e.into());
            return params::with_value_id(param, id);
        }
        let device = param.lazy_device();
        params::with_value(param, params::upload(flat, &device), id)
    }
}

/// What differs between this rank's parameter shapes and rank 0's, if anything.
fn describe_difference(mine: &[Vec<usize>], rank0: &[Vec<usize>]) -> Option<String> {
    if mine.len() != rank0.len() {
        return Some(format!(
            "this process's model has {} float parameters, rank 0's has {}",
            mine.len(),
            rank0.len()
        ));
    }
    mine.iter().zip(rank0).position(|(a, b)| a != b).map(|i| {
        format!(
            "parameter #{i} has shape {:?} here and {:?} on rank 0",
            mine[i], rank0[i]
        )
    })
}
