//! Every process starts from rank 0's model: each rank checks that it built the same model
//! (float parameter shapes, in visit order), then takes rank 0's parameter values and ids, so
//! that optimizer records and checkpoints line up too. Shards of sharded units (ZeRO-3) differ
//! between ranks by design and keep their values.

use burn::module::{Module, ParamId};

use crate::error::AccelerateError;
use crate::group::Comm;
use crate::params::{self, ParamLayout, Replacement};

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
    // Shard parameters have rank 0's ids already (they were cut from rank 0's unit).
    let whole: Vec<bool> = layout.entries.iter().map(|e| !is_shard(e.id)).collect();
    let whole_numel = layout
        .entries
        .iter()
        .zip(&whole)
        .filter(|(_, whole)| **whole)
        .map(|(e, _)| e.numel)
        .sum();
    let mut flat = if rank == 0 {
        params::values(&model)
            .into_iter()
            .zip(&whole)
            .filter(|(_, whole)| **whole)
            .flat_map(|(value, _)| params::to_host_f32(value))
            .collect()
    } else {
        vec![0.0; whole_numel]
    };
    group.broadcast(&mut flat, 0)?;
    drop(group);

    let device = model.devices().into_iter().next().unwrap_or_default();
    let mut offset = 0;
    let values = layout
        .entries
        .iter()
        .zip(&whole)
        .map(|(entry, whole)| {
            if !whole {
                return None;
            }
            let part = flat[offset..offset + entry.numel].to_vec();
            offset += entry.numel;
            Some(params::upload(part, &device))
        })
        .collect();
    Ok(params::replace(model, Replacement { values, ids }))
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
