//! The fused AdamW / Adam / SGD updates of [`crate::optim`] on the device, per parameter
//! segment of a flat buffer: the same formulas in the same order, read-once write-once.
//!
//! The parameters are written to a separate output buffer (`params` is only read), so tensors
//! that still view the old parameters keep their values; the optimizer state is updated in
//! place. Results equal the host kernels up to the device's rounding of division and square
//! root (WGSL allows a few ulps), so the tests compare within a tolerance.

use cubecl::prelude::*;

use super::{Client, Handle, buffer, grid};
use crate::optim::{AdamConstants, AdamHyper, SgdHyper};

#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn adam_kernel(
    params: &[f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max_v: &mut [f32],
    out: &mut [f32],
    start: u32,
    count: u32,
    grad_scale: f32,
    beta_1: f32,
    beta_2: f32,
    factor_1: f32,
    factor_2: f32,
    correction_1: f32,
    correction_2: f32,
    epsilon: f32,
    decay: f32,
    lr: f32,
    #[comptime] decoupled: bool,
    #[comptime] first: bool,
    #[comptime] amsgrad: bool,
) {
    if ABSOLUTE_POS < count as usize {
        let i = start as usize + ABSOLUTE_POS;
        let p = params[i];
        let mut grad = grads[i] * grad_scale;
        if comptime!(!decoupled) {
            grad += p * decay;
        }
        let mut m1 = grad * factor_1;
        let mut m2 = grad * grad * factor_2;
        if comptime!(!first) {
            m1 = m[i] * beta_1 + grad * factor_1;
            m2 = v[i] * beta_2 + grad * grad * factor_2;
        }
        m[i] = m1;
        v[i] = m2;
        let mut used = m2;
        if comptime!(amsgrad) {
            if comptime!(!first) {
                let previous = max_v[i];
                if previous > m2 {
                    used = previous;
                }
            }
            max_v[i] = used;
        }
        if comptime!(decoupled) {
            let delta = (m1 / correction_1) / ((used / correction_2).sqrt() + epsilon);
            out[i] = p * decay - delta * lr;
        } else {
            out[i] = p - (m1 * correction_1) / (used.sqrt() + correction_2) * lr;
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn sgd_kernel(
    params: &[f32],
    grads: &[f32],
    velocity: &mut [f32],
    out: &mut [f32],
    start: u32,
    count: u32,
    grad_scale: f32,
    lr: f32,
    decay: f32,
    keep: f32,
    momentum: f32,
    #[comptime] has_momentum: bool,
    #[comptime] nesterov: bool,
    #[comptime] first: bool,
) {
    if ABSOLUTE_POS < count as usize {
        let i = start as usize + ABSOLUTE_POS;
        let p = params[i];
        let mut grad = grads[i];
        if grad_scale != 1.0f32 {
            grad *= grad_scale;
        }
        if decay != 0.0f32 {
            grad += p * decay;
        }
        if comptime!(has_momentum) {
            let mut new_v = grad;
            if comptime!(!first) {
                new_v = grad * keep + velocity[i] * momentum;
            }
            velocity[i] = new_v;
            let mut step = new_v;
            if comptime!(nesterov) {
                step = new_v * momentum + grad;
            }
            out[i] = p - step * lr;
        } else {
            out[i] = p - grad * lr;
        }
    }
}

#[cube(launch)]
fn copy_kernel(input: &[f32], out: &mut [f32], start: u32, count: u32) {
    if ABSOLUTE_POS < count as usize {
        let i = start as usize + ABSOLUTE_POS;
        out[i] = input[i];
    }
}

/// The flat buffers of one fused update, each of `len` f32 values. `params` is read and the
/// updated values go to `out`; the state buffers are updated in place.
#[derive(Debug, Clone)]
pub struct FlatBuffers {
    /// Parameters before the update (read only).
    pub params: Handle,
    /// Gradients (read only).
    pub grads: Handle,
    /// Optimizer state, in the order of [`crate::optim`]: `m`, `v` (and `max_v` with AMSGrad)
    /// for Adam; `velocity` (with momentum) for SGD.
    pub state: Vec<Handle>,
    /// Parameters after the update (written; segments not updated must be copied).
    pub out: Handle,
    /// Elements in every buffer.
    pub len: usize,
}

impl FlatBuffers {
    fn arg(&self, handle: &Handle) -> BufferArg {
        // The kernels index `start..start + count`, checked against `len` by `segment`.
        buffer(handle.clone(), self.len, "fused update buffer")
    }

    /// A placeholder for a state buffer the kernel does not touch: a distinct buffer, because
    /// a buffer bound twice for writing is invalid on some runtimes.
    fn unused(client: &Client) -> BufferArg {
        let handle = client.empty(4);
        // One f32 of storage; the kernel never indexes it (its comptime flag is off).
        buffer(handle, 1, "unused state")
    }

    fn segment(&self, start: usize, count: usize) -> (u32, u32) {
        assert!(
            start + count <= self.len,
            "fused update: segment {start}..{} is outside the {} values",
            start + count,
            self.len
        );
        let narrow = |n: usize| u32::try_from(n).expect("flat buffers hold fewer than 2^32 values");
        (narrow(start), narrow(count))
    }
}

/// One Adam or AdamW update of `count` values from `start` (step `time`, learning rate `lr`,
/// gradients multiplied by `grad_scale`), like [`crate::optim::adam_step`].
#[allow(clippy::too_many_arguments)]
pub fn adam_step(
    client: &Client,
    buffers: &FlatBuffers,
    start: usize,
    count: usize,
    time: i32,
    lr: f64,
    grad_scale: f32,
    hyper: &AdamHyper,
    amsgrad: bool,
) {
    let (first_index, n) = buffers.segment(start, count);
    if count == 0 {
        return;
    }
    let c = AdamConstants::new(hyper, time, lr);
    let state = |i: usize| buffers.state.get(i).map(|h| buffers.arg(h));
    let (Some(m), Some(v)) = (state(0), state(1)) else {
        panic!("adam_step: Adam needs the m and v buffers");
    };
    let max_v = if amsgrad {
        state(2).expect("adam_step: AMSGrad needs the max_v buffer")
    } else {
        FlatBuffers::unused(client)
    };
    let (cube_count, dim) = grid(client, count);
    adam_kernel::launch(
        client,
        cube_count,
        dim,
        buffers.arg(&buffers.params),
        buffers.arg(&buffers.grads),
        m,
        v,
        max_v,
        buffers.arg(&buffers.out),
        first_index,
        n,
        grad_scale,
        c.beta_1,
        c.beta_2,
        c.factor_1,
        c.factor_2,
        c.correction_1,
        c.correction_2,
        c.epsilon,
        c.decay,
        c.lr,
        c.decoupled,
        time == 1,
        amsgrad,
    );
}

/// One SGD update of `count` values from `start`, like [`crate::optim::sgd_step`]; `first`
/// says the velocity holds nothing yet.
#[allow(clippy::too_many_arguments)]
pub fn sgd_step(
    client: &Client,
    buffers: &FlatBuffers,
    start: usize,
    count: usize,
    first: bool,
    lr: f64,
    grad_scale: f32,
    hyper: &SgdHyper,
) {
    let (first_index, n) = buffers.segment(start, count);
    if count == 0 {
        return;
    }
    let velocity = match (hyper.momentum, buffers.state.first()) {
        (Some(_), Some(v)) => buffers.arg(v),
        (Some(_), None) => panic!("sgd_step: momentum needs a velocity buffer"),
        (None, _) => FlatBuffers::unused(client),
    };
    let momentum = hyper.momentum;
    let (cube_count, dim) = grid(client, count);
    sgd_kernel::launch(
        client,
        cube_count,
        dim,
        buffers.arg(&buffers.params),
        buffers.arg(&buffers.grads),
        velocity,
        buffers.arg(&buffers.out),
        first_index,
        n,
        grad_scale,
        lr as f32,
        hyper.weight_decay.unwrap_or(0.0),
        momentum.map_or(1.0, |m| (1.0 - m.dampening) as f32),
        momentum.map_or(0.0, |m| m.momentum),
        momentum.is_some(),
        momentum.is_some_and(|m| m.nesterov),
        first,
    );
}

/// Copies `count` parameters from `start` unchanged (a segment without a gradient).
pub fn copy_params(client: &Client, buffers: &FlatBuffers, start: usize, count: usize) {
    let (first_index, n) = buffers.segment(start, count);
    if count == 0 {
        return;
    }
    let (cube_count, dim) = grid(client, count);
    copy_kernel::launch(
        client,
        cube_count,
        dim,
        buffers.arg(&buffers.params),
        buffers.arg(&buffers.out),
        first_index,
        n,
    );
}
