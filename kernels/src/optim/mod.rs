//! Fused optimizer updates over flat `f32` buffers: one pass reads the gradient, applies the
//! gradient scale (fp16 unscale times the clipping coefficient), updates the moments and the
//! parameter in place. No allocation; chunks are split across Rayon's threads.
//!
//! The arithmetic follows Burn 0.22's optimizers operation by operation (same order, same
//! precision of every constant), so a fused step equals Burn's up to the rounding of the
//! gradient scale, which Burn does not have.

use rayon::prelude::*;

pub(crate) mod lanes;

pub(crate) use lanes::{AdamConstants, Lanes, adam_lanes};

/// Elements per parallel task: large enough that scheduling is noise, small enough that two
/// threads share a 1 M-element update evenly.
const CHUNK: usize = 1 << 15;

/// Adam-family settings (Burn's `AdamConfig` / `AdamWConfig` fields).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamHyper {
    /// First-moment decay.
    pub beta_1: f32,
    /// Second-moment decay.
    pub beta_2: f32,
    /// Added to the denominator.
    pub epsilon: f32,
    /// AdamW: decoupled decay of the parameter (`p *= 1 - lr * wd`); Adam: L2 penalty added to
    /// the gradient (`g += wd * p`).
    pub weight_decay: f32,
    /// Decoupled (AdamW) or L2 (Adam) weight decay, and the matching bias correction.
    pub decoupled: bool,
}

/// One Adam or AdamW update of `params` at step `time` (1 for the first update), with
/// learning rate `lr` and gradients multiplied by `grad_scale` first. `max_v` is the AMSGrad
/// running maximum of the second moment, when enabled.
#[allow(clippy::too_many_arguments)]
pub fn adam_step(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max_v: Option<&mut [f32]>,
    time: i32,
    lr: f64,
    grad_scale: f32,
    hyper: &AdamHyper,
) {
    let n = params.len();
    assert!(
        grads.len() == n && m.len() == n && v.len() == n,
        "adam_step: lengths differ"
    );
    let constants = AdamConstants::new(hyper, time, lr);
    let first = time == 1;
    match max_v {
        Some(max_v) => {
            assert_eq!(max_v.len(), n, "adam_step: max_v length differs");
            params
                .par_chunks_mut(CHUNK)
                .zip(grads.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK))
                .zip(v.par_chunks_mut(CHUNK))
                .zip(max_v.par_chunks_mut(CHUNK))
                .for_each(|((((p, g), m), v), mv)| {
                    adam_chunk(p, g, m, v, Some(mv), first, grad_scale, &constants);
                });
        }
        None => params
            .par_chunks_mut(CHUNK)
            .zip(grads.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| {
                adam_chunk(p, g, m, v, None, first, grad_scale, &constants);
            }),
    }
}

impl AdamConstants {
    pub(crate) fn new(h: &AdamHyper, time: i32, lr: f64) -> Self {
        let (correction_1, correction_2, epsilon, decay) = if h.decoupled {
            let decay_rate = lr * f64::from(h.weight_decay);
            (
                1.0 - h.beta_1.powi(time),
                1.0 - h.beta_2.powi(time),
                h.epsilon,
                if decay_rate == 0.0 {
                    1.0
                } else {
                    (1.0 - decay_rate) as f32
                },
            )
        } else {
            let bias_correction2_sqrt = (1.0 - h.beta_2.powi(time)).sqrt();
            (
                bias_correction2_sqrt / (1.0 - h.beta_1.powi(time)),
                h.epsilon * bias_correction2_sqrt,
                h.epsilon,
                h.weight_decay,
            )
        };
        Self {
            beta_1: h.beta_1,
            beta_2: h.beta_2,
            factor_1: 1.0 - h.beta_1,
            factor_2: 1.0 - h.beta_2,
            decoupled: h.decoupled,
            correction_1,
            correction_2,
            epsilon,
            decay,
            lr: lr as f32,
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn adam_chunk(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max_v: Option<&mut [f32]>,
    first: bool,
    grad_scale: f32,
    c: &AdamConstants,
) {
    // Every flag is hoisted out of the loop into a monomorphised copy, and the loops zip
    // slices, so each copy vectorises without bounds checks.
    let lanes = Lanes { p, g, m, v };
    match (max_v, c.decoupled, first) {
        (None, true, true) => adam_best::<true, true>(lanes, grad_scale, c),
        (None, true, false) => adam_best::<true, false>(lanes, grad_scale, c),
        (None, false, true) => adam_best::<false, true>(lanes, grad_scale, c),
        (None, false, false) => adam_best::<false, false>(lanes, grad_scale, c),
        (Some(max_v), _, _) => {
            let Lanes { p, g, m, v } = lanes;
            adam_amsgrad(p, g, m, v, max_v, first, grad_scale, c);
        }
    }
}

/// [`adam_lanes`] built for the widest vectors this CPU has.
#[inline(always)]
fn adam_best<const DECOUPLED: bool, const FIRST: bool>(
    lanes: Lanes<'_>,
    grad_scale: f32,
    c: &AdamConstants,
) {
    #[cfg(target_arch = "x86_64")]
    let Some(lanes) = crate::x86::try_adam_lanes::<DECOUPLED, FIRST>(lanes, grad_scale, c) else {
        return;
    };
    adam_lanes::<DECOUPLED, FIRST>(lanes, grad_scale, c);
}

/// AMSGrad: the second moment used is the running maximum (rarely used; kept simple).
#[allow(clippy::too_many_arguments)]
fn adam_amsgrad(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max_v: &mut [f32],
    first: bool,
    grad_scale: f32,
    c: &AdamConstants,
) {
    let lanes = p
        .iter_mut()
        .zip(g)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
        .zip(max_v.iter_mut());
    for ((((p, &g), m), v), max_v) in lanes {
        let mut grad = g * grad_scale;
        if !c.decoupled {
            grad += *p * c.decay;
        }
        let (m1, m2) = if first {
            (grad * c.factor_1, grad * grad * c.factor_2)
        } else {
            (
                *m * c.beta_1 + grad * c.factor_1,
                *v * c.beta_2 + grad * grad * c.factor_2,
            )
        };
        *m = m1;
        *v = m2;
        let used = if first { m2 } else { max_v.max(m2) };
        *max_v = used;
        *p = if c.decoupled {
            let delta = (m1 / c.correction_1) / ((used / c.correction_2).sqrt() + c.epsilon);
            *p * c.decay - delta * c.lr
        } else {
            *p - (m1 * c.correction_1) / (used.sqrt() + c.correction_2) * c.lr
        };
    }
}

/// SGD settings (Burn's `SgdConfig` with its optional weight decay and momentum).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdHyper {
    /// L2 penalty added to the gradient (`g += wd * p`), when set.
    pub weight_decay: Option<f32>,
    /// Momentum, dampening and Nesterov, when set.
    pub momentum: Option<SgdMomentum>,
}

/// Burn's `MomentumConfig`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdMomentum {
    /// Momentum factor.
    pub momentum: f32,
    /// Dampening of the new gradient (Burn's default is 0.1).
    pub dampening: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// One SGD update; `velocity` is the momentum buffer (required with momentum), `first` says
/// it holds nothing yet.
pub fn sgd_step(
    params: &mut [f32],
    grads: &[f32],
    velocity: Option<&mut [f32]>,
    first: bool,
    lr: f64,
    grad_scale: f32,
    hyper: &SgdHyper,
) {
    let n = params.len();
    assert_eq!(grads.len(), n, "sgd_step: lengths differ");
    let lr = lr as f32;
    let decay = hyper.weight_decay.unwrap_or(0.0);
    let scaled = move |p: f32, g: f32| {
        let grad = if grad_scale == 1.0 { g } else { g * grad_scale };
        if decay != 0.0 { p * decay + grad } else { grad }
    };
    match (hyper.momentum, velocity) {
        (Some(mom), Some(velocity)) => {
            assert_eq!(velocity.len(), n, "sgd_step: velocity length differs");
            let keep = (1.0 - mom.dampening) as f32;
            params
                .par_chunks_mut(CHUNK)
                .zip(grads.par_chunks(CHUNK))
                .zip(velocity.par_chunks_mut(CHUNK))
                .for_each(|((p, g), vel)| {
                    for i in 0..p.len() {
                        let grad = scaled(p[i], g[i]);
                        let new_v = if first {
                            grad
                        } else {
                            grad * keep + vel[i] * mom.momentum
                        };
                        vel[i] = new_v;
                        let step = if mom.nesterov {
                            new_v * mom.momentum + grad
                        } else {
                            new_v
                        };
                        p[i] -= step * lr;
                    }
                });
        }
        (Some(_), None) => panic!("sgd_step: momentum needs a velocity buffer"),
        (None, _) => params
            .par_chunks_mut(CHUNK)
            .zip(grads.par_chunks(CHUNK))
            .for_each(|(p, g)| {
                for i in 0..p.len() {
                    let grad = scaled(p[i], g[i]);
                    p[i] -= grad * lr;
                }
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Burn's AdamW written out as its tensor operations would run, one element at a time.
    fn reference_adamw(p: &mut [f32], steps: &[Vec<f32>], h: &AdamHyper, lr: f64) {
        let (mut m, mut v) = (vec![0.0f32; p.len()], vec![0.0f32; p.len()]);
        for (t, g) in steps.iter().enumerate() {
            let time = t as i32 + 1;
            for i in 0..p.len() {
                if t == 0 {
                    m[i] = g[i] * (1.0 - h.beta_1);
                    v[i] = g[i] * g[i] * (1.0 - h.beta_2);
                } else {
                    m[i] = m[i] * h.beta_1 + g[i] * (1.0 - h.beta_1);
                    v[i] = v[i] * h.beta_2 + g[i] * g[i] * (1.0 - h.beta_2);
                }
                let mh = m[i] / (1.0 - h.beta_1.powi(time));
                let vh = v[i] / (1.0 - h.beta_2.powi(time));
                let delta = mh / (vh.sqrt() + h.epsilon);
                let decay = lr * f64::from(h.weight_decay);
                p[i] = p[i] * (1.0 - decay) as f32 - delta * lr as f32;
            }
        }
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2000) as f32 / 1000.0
                    - 1.0
            })
            .collect()
    }

    #[test]
    fn fused_adamw_equals_the_reference_bit_for_bit() {
        let h = AdamHyper {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            weight_decay: 0.01,
            decoupled: true,
        };
        let n = 3 * CHUNK + 17;
        let steps: Vec<Vec<f32>> = (0..5).map(|s| data(n, s)).collect();
        let mut expected = data(n, 99);
        reference_adamw(&mut expected, &steps, &h, 1e-3);
        let mut p = data(n, 99);
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        for (t, g) in steps.iter().enumerate() {
            adam_step(&mut p, g, &mut m, &mut v, None, t as i32 + 1, 1e-3, 1.0, &h);
        }
        assert!(p == expected);
    }

    #[test]
    fn the_gradient_scale_is_applied_before_everything() {
        let h = AdamHyper {
            beta_1: 0.9,
            beta_2: 0.99,
            epsilon: 1e-8,
            weight_decay: 0.1,
            decoupled: false,
        };
        let n = 1000;
        let g = data(n, 1);
        let scaled: Vec<f32> = g.iter().map(|x| x * 0.5).collect();
        let (mut a, mut b) = (data(n, 2), data(n, 2));
        let (mut m1, mut v1, mut m2, mut v2) =
            (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        adam_step(&mut a, &g, &mut m1, &mut v1, None, 1, 0.1, 0.5, &h);
        adam_step(&mut b, &scaled, &mut m2, &mut v2, None, 1, 0.1, 1.0, &h);
        assert!(a == b && m1 == m2 && v1 == v2);
    }

    #[test]
    fn sgd_with_nesterov_momentum_and_decay_follows_burns_formula() {
        let hyper = SgdHyper {
            weight_decay: Some(0.01),
            momentum: Some(SgdMomentum {
                momentum: 0.9,
                dampening: 0.1,
                nesterov: true,
            }),
        };
        let n = CHUNK + 3;
        let mut p = data(n, 5);
        let mut expected = p.clone();
        let mut vel = vec![0.0; n];
        let mut ref_vel = vec![0.0f32; n];
        for s in 0..4 {
            let g = data(n, s);
            sgd_step(&mut p, &g, Some(&mut vel), s == 0, 0.05, 1.0, &hyper);
            for i in 0..n {
                let grad = expected[i] * 0.01 + g[i];
                ref_vel[i] = if s == 0 {
                    grad
                } else {
                    grad * (1.0 - 0.1f64) as f32 + ref_vel[i] * 0.9
                };
                expected[i] -= (ref_vel[i] * 0.9 + grad) * 0.05f64 as f32;
            }
        }
        assert!(p == expected);
    }
}
