//! The fused AdamW / Adam / SGD updates of [`crate::optim`] on the device, per parameter
//! segment of a flat buffer: the same formulas in the same order, read-once write-once.
//!
//! The parameters are written to a separate output buffer (`params` is only read), so tensors
//! that still view the old parameters keep their values; the optimizer state is updated in
//! place. Results equal the host kernels up to the device's rounding of division and square
//! root (WGSL allows a few ulps), so the tests compare within a tolerance.

use std::ops::Range;

use cubecl::prelude::*;

use super::{Client, Handle, buffer, grid};
use crate::optim::{AdamConstants, AdamHyper, SgdHyper};

/// Adam over `count` vectors of `N` values (the arguments count vectors, not values): the
/// same operations on each lane as on one value, so every vector size gives the same bits.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn adam_kernel<N: Size>(
    params: &[Vector<f32, N>],
    grads: &[Vector<f32, N>],
    m: &mut [Vector<f32, N>],
    v: &mut [Vector<f32, N>],
    max_v: &mut [Vector<f32, N>],
    out: &mut [Vector<f32, N>],
    start: u32,
    param_start: u32,
    grad_start: u32,
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
        let j = param_start as usize + ABSOLUTE_POS;
        let p = params[j];
        let decay = Vector::<f32, N>::new(decay);
        let factor_1 = Vector::<f32, N>::new(factor_1);
        let factor_2 = Vector::<f32, N>::new(factor_2);
        let mut grad =
            grads[grad_start as usize + ABSOLUTE_POS] * Vector::<f32, N>::new(grad_scale);
        if comptime!(!decoupled) {
            grad += p * decay;
        }
        let mut m1 = grad * factor_1;
        let mut m2 = grad * grad * factor_2;
        if comptime!(!first) {
            m1 = m[i] * Vector::<f32, N>::new(beta_1) + grad * factor_1;
            m2 = v[i] * Vector::<f32, N>::new(beta_2) + grad * grad * factor_2;
        }
        m[i] = m1;
        v[i] = m2;
        let mut used = m2;
        if comptime!(amsgrad) {
            if comptime!(!first) {
                let previous = max_v[i];
                used = select_many(previous.greater_than(&m2), previous, m2);
            }
            max_v[i] = used;
        }
        let lr = Vector::<f32, N>::new(lr);
        let correction_1 = Vector::<f32, N>::new(correction_1);
        let correction_2 = Vector::<f32, N>::new(correction_2);
        if comptime!(decoupled) {
            let epsilon = Vector::<f32, N>::new(epsilon);
            let delta = (m1 / correction_1) / ((used / correction_2).sqrt() + epsilon);
            out[j] = p * decay - delta * lr;
        } else {
            out[j] = p - (m1 * correction_1) / (used.sqrt() + correction_2) * lr;
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
    param_start: u32,
    grad_start: u32,
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
        let j = param_start as usize + ABSOLUTE_POS;
        let p = params[j];
        let mut grad = grads[grad_start as usize + ABSOLUTE_POS];
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
            out[j] = p - step * lr;
        } else {
            out[j] = p - grad * lr;
        }
    }
}

#[cube(launch)]
fn copy_kernel(input: &[f32], out: &mut [f32], param_start: u32, count: u32) {
    if ABSOLUTE_POS < count as usize {
        let j = param_start as usize + ABSOLUTE_POS;
        out[j] = input[j];
    }
}

/// The flat buffers of one fused update, each of `len` f32 values, except `params` and `out`,
/// which hold `params_range` of them, and `grads`, which holds `grads_range`: all, or one
/// segment, so that an update can read a parameter and its gradient from tensors of their own
/// and write the new values to a buffer of their own (no view into a flat buffer, which a
/// backend may have to copy out, and no copy into one). `params` is read and the updated
/// values go to `out`; the state buffers are updated in place.
#[derive(Debug, Clone)]
pub struct FlatBuffers {
    /// Parameters before the update (read only), the values of `params_range`.
    pub params: Handle,
    /// Gradients (read only), the values of `grads_range`.
    pub grads: Handle,
    /// Optimizer state, in the order of [`crate::optim`]: `m`, `v` (and `max_v` with AMSGrad)
    /// for Adam; `velocity` (with momentum) for SGD.
    pub state: Vec<Handle>,
    /// Parameters after the update (written; segments not updated must be copied), the values
    /// of `params_range`.
    pub out: Handle,
    /// Elements in the state buffers (and in the others where their range is `0..len`).
    pub len: usize,
    /// The flat indices `params` and `out` hold: `0..len`, or one segment's range.
    pub params_range: Range<usize>,
    /// The flat indices `grads` holds: `0..len`, or one segment's range.
    pub grads_range: Range<usize>,
}

/// The kernel arguments of one segment: where it starts in the state, the parameters and the
/// gradients, and its length.
struct SegmentArgs {
    start: u32,
    param_start: u32,
    grad_start: u32,
    count: u32,
}

/// Values per vector where a segment's three indices allow it: 4 f32 (16 bytes, what WGSL's
/// `vec4` and a 128-bit load hold), else 1.
const VECTOR: u32 = 4;

impl SegmentArgs {
    /// The widest vector this segment can be read in, and its indices counted in vectors.
    fn vectorized(&self) -> (usize, Self) {
        let width = if [self.start, self.param_start, self.grad_start, self.count]
            .iter()
            .all(|n| n.is_multiple_of(VECTOR))
        {
            VECTOR
        } else {
            1
        };
        let in_vectors = Self {
            start: self.start / width,
            param_start: self.param_start / width,
            grad_start: self.grad_start / width,
            count: self.count / width,
        };
        (width as usize, in_vectors)
    }
}

impl FlatBuffers {
    fn arg(&self, handle: &Handle) -> BufferArg {
        // The kernels index `start..start + count`, checked against `len` by `segment`.
        buffer(handle.clone(), self.len, "fused update buffer")
    }

    fn grads_arg(&self) -> BufferArg {
        // Indexed `grad_start..grad_start + count`, checked by `segment`.
        buffer(
            self.grads.clone(),
            self.grads_range.len(),
            "fused update gradients",
        )
    }

    fn param_arg(&self, handle: &Handle) -> BufferArg {
        // Indexed `param_start..param_start + count`, checked by `segment`.
        buffer(
            handle.clone(),
            self.params_range.len(),
            "fused update parameters",
        )
    }

    /// A placeholder for a state buffer the kernel does not touch: a distinct buffer, because
    /// a buffer bound twice for writing is invalid on some runtimes.
    fn unused(client: &Client) -> BufferArg {
        // One vector of storage (a binding must hold at least one element of its array
        // type); the kernel never indexes it (its comptime flag is off).
        let len = VECTOR as usize;
        buffer(client.empty(len * 4), len, "unused state")
    }

    fn segment(&self, start: usize, count: usize) -> SegmentArgs {
        let end = start + count;
        let within = |range: &Range<usize>| start >= range.start && end <= range.end;
        assert!(
            end <= self.len && within(&self.params_range) && within(&self.grads_range),
            "fused update: segment {start}..{end} is outside the {} values, the parameters' \
             range {:?} or the gradients' {:?}",
            self.len,
            self.params_range,
            self.grads_range
        );
        let narrow = |n: usize| u32::try_from(n).expect("flat buffers hold fewer than 2^32 values");
        SegmentArgs {
            start: narrow(start),
            param_start: narrow(start - self.params_range.start),
            grad_start: narrow(start - self.grads_range.start),
            count: narrow(count),
        }
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
    let segment = buffers.segment(start, count);
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
    let (width, segment) = segment.vectorized();
    let (cube_count, dim) = grid(client, segment.count as usize);
    adam_kernel::launch(
        client,
        cube_count,
        dim,
        width,
        buffers.param_arg(&buffers.params),
        buffers.grads_arg(),
        m,
        v,
        max_v,
        buffers.param_arg(&buffers.out),
        segment.start,
        segment.param_start,
        segment.grad_start,
        segment.count,
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
    let segment = buffers.segment(start, count);
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
        buffers.param_arg(&buffers.params),
        buffers.grads_arg(),
        velocity,
        buffers.param_arg(&buffers.out),
        segment.start,
        segment.param_start,
        segment.grad_start,
        segment.count,
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
    let segment = buffers.segment(start, count);
    if count == 0 {
        return;
    }
    let (cube_count, dim) = grid(client, count);
    copy_kernel::launch(
        client,
        cube_count,
        dim,
        buffers.param_arg(&buffers.params),
        buffers.param_arg(&buffers.out),
        segment.param_start,
        segment.count,
    );
}
