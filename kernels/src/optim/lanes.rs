//! The Adam update's loop over one chunk of lanes, on one thread, and the per-step constants
//! it reads: the portable code, which the AVX2 build in `x86` inlines too (the same IEEE
//! operations in the same order, so the same bits).

/// The per-step constants of an Adam update, computed as Burn computes them.
pub(crate) struct AdamConstants {
    pub(crate) beta_1: f32,
    pub(crate) beta_2: f32,
    pub(crate) factor_1: f32,
    pub(crate) factor_2: f32,
    pub(crate) decoupled: bool,
    /// AdamW: `1 - b1^t` and `1 - b2^t`; Adam: the combined factor and `eps * sqrt(1 - b2^t)`.
    pub(crate) correction_1: f32,
    pub(crate) correction_2: f32,
    pub(crate) epsilon: f32,
    /// AdamW: `1 - lr * wd` (0 decay skips it); Adam: the L2 penalty.
    pub(crate) decay: f32,
    pub(crate) lr: f32,
}

/// One chunk of the Adam update: parameters, gradients, first and second moments.
pub(crate) struct Lanes<'a> {
    pub(crate) p: &'a mut [f32],
    pub(crate) g: &'a [f32],
    pub(crate) m: &'a mut [f32],
    pub(crate) v: &'a mut [f32],
}

/// The Adam update of one chunk: every flag a const parameter, so each copy vectorises.
#[inline(always)]
pub(crate) fn adam_lanes<const DECOUPLED: bool, const FIRST: bool>(
    lanes: Lanes<'_>,
    grad_scale: f32,
    c: &AdamConstants,
) {
    let Lanes { p, g, m, v } = lanes;
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let mut grad = g * grad_scale;
        if !DECOUPLED {
            grad += *p * c.decay;
        }
        let (m1, m2) = if FIRST {
            (grad * c.factor_1, grad * grad * c.factor_2)
        } else {
            (
                *m * c.beta_1 + grad * c.factor_1,
                *v * c.beta_2 + grad * grad * c.factor_2,
            )
        };
        *m = m1;
        *v = m2;
        *p = if DECOUPLED {
            let delta = (m1 / c.correction_1) / ((m2 / c.correction_2).sqrt() + c.epsilon);
            *p * c.decay - delta * c.lr
        } else {
            *p - (m1 * c.correction_1) / (m2.sqrt() + c.correction_2) * c.lr
        };
    }
}
