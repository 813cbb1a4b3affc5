//! [`FusedOptimizer`]: which fused update, read from Burn's own optimizer configs.
//!
//! Burn's config fields are private, so they are read through their serde form; anything the
//! fused kernels do not implement (per-tensor clipping, cautious weight decay) is refused with
//! a hint instead of being ignored.

use accelerate_kernels::optim::{AdamHyper, SgdHyper, SgdMomentum};
use burn::optim::{AdamConfig, AdamWConfig, SgdConfig};
use serde::{Deserialize, Serialize};

use crate::error::AccelerateError;

/// Which fused update, with Burn's hyperparameters. Build it from Burn's own configs with
/// [`adamw`](Self::adamw), [`adam`](Self::adam) or [`sgd`](Self::sgd) and give it to
/// `acc.prepare((model, fused, ...))` in place of `config.init()`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum FusedOptimizer {
    /// Adam (L2 weight decay) or AdamW (decoupled weight decay), with optional AMSGrad.
    Adam {
        /// The hyperparameters.
        hyper: AdamHyper,
        /// Keep the running maximum of the second moment.
        amsgrad: bool,
    },
    /// SGD with optional L2 weight decay and momentum.
    Sgd {
        /// L2 penalty.
        weight_decay: Option<f32>,
        /// `(momentum, dampening, nesterov)`.
        momentum: Option<(f32, f64, bool)>,
    },
}

fn config_error(config: &'static str, what: String) -> AccelerateError {
    AccelerateError::NotFusable {
        config,
        what,
        hint: "use Burn's optimizer (config.init()) for settings the fused update lacks",
    }
}

/// Reads a Burn config's fields through its serde form (Burn's config fields are private).
fn fields(
    config: &impl Serialize,
    what: &'static str,
) -> Result<serde_json::Value, AccelerateError> {
    serde_json::to_value(config).map_err(|e| config_error(what, e.to_string()))
}

fn number(v: &serde_json::Value, key: &str, what: &'static str) -> Result<f64, AccelerateError> {
    v.get(key)
        .and_then(serde_json::Value::as_f64)
        .ok_or_else(|| config_error(what, format!("no numeric field `{key}` in {v}")))
}

fn refuse_clipping(
    v: &serde_json::Value,
    key: &str,
    what: &'static str,
) -> Result<(), AccelerateError> {
    if v.get(key).is_some_and(|c| !c.is_null()) {
        return Err(AccelerateError::NotFusable {
            config: what,
            what: "per-tensor gradient clipping is not fused".into(),
            hint: "clip over all parameters with acc.clip_grad_norm(&model, &mut grads, \
                   max_norm), which the fused step applies",
        });
    }
    Ok(())
}

impl FusedOptimizer {
    /// Burn's AdamW, fused (same formula and defaults).
    pub fn adamw(config: &AdamWConfig) -> Result<Self, AccelerateError> {
        let what = "AdamWConfig";
        let v = fields(config, what)?;
        refuse_clipping(&v, "grad_clipping", what)?;
        if v.get("cautious_weight_decay")
            .and_then(serde_json::Value::as_bool)
            == Some(true)
        {
            return Err(config_error(
                what,
                "cautious weight decay is not fused".into(),
            ));
        }
        Ok(Self::Adam {
            hyper: AdamHyper {
                beta_1: number(&v, "beta_1", what)? as f32,
                beta_2: number(&v, "beta_2", what)? as f32,
                epsilon: number(&v, "epsilon", what)? as f32,
                weight_decay: number(&v, "weight_decay", what)? as f32,
                decoupled: true,
            },
            amsgrad: v.get("amsgrad").and_then(serde_json::Value::as_bool) == Some(true),
        })
    }

    /// Burn's Adam, fused.
    pub fn adam(config: &AdamConfig) -> Result<Self, AccelerateError> {
        let what = "AdamConfig";
        let v = fields(config, what)?;
        refuse_clipping(&v, "grad_clipping", what)?;
        let weight_decay = match v.get("weight_decay") {
            Some(wd) if !wd.is_null() => number(wd, "penalty", what)? as f32,
            _ => 0.0,
        };
        Ok(Self::Adam {
            hyper: AdamHyper {
                beta_1: number(&v, "beta_1", what)? as f32,
                beta_2: number(&v, "beta_2", what)? as f32,
                epsilon: number(&v, "epsilon", what)? as f32,
                weight_decay,
                decoupled: false,
            },
            amsgrad: v.get("amsgrad").and_then(serde_json::Value::as_bool) == Some(true),
        })
    }

    /// Burn's SGD (with its weight decay and momentum), fused.
    pub fn sgd(config: &SgdConfig) -> Result<Self, AccelerateError> {
        let what = "SgdConfig";
        let v = fields(config, what)?;
        refuse_clipping(&v, "gradient_clipping", what)?;
        let weight_decay = match v.get("weight_decay") {
            Some(wd) if !wd.is_null() => Some(number(wd, "penalty", what)? as f32),
            _ => None,
        };
        let momentum = match v.get("momentum") {
            Some(m) if !m.is_null() => Some((
                number(m, "momentum", what)? as f32,
                number(m, "dampening", what)?,
                m.get("nesterov").and_then(serde_json::Value::as_bool) == Some(true),
            )),
            _ => None,
        };
        Ok(Self::Sgd {
            weight_decay,
            momentum,
        })
    }

    /// The kernels' SGD settings (`None` for Adam).
    pub(crate) fn sgd_hyper(&self) -> Option<SgdHyper> {
        match self {
            Self::Sgd {
                weight_decay,
                momentum,
            } => Some(SgdHyper {
                weight_decay: *weight_decay,
                momentum: momentum.map(|(momentum, dampening, nesterov)| SgdMomentum {
                    momentum,
                    dampening,
                    nesterov,
                }),
            }),
            Self::Adam { .. } => None,
        }
    }

    /// Flat state buffers per parameter element (moments, velocity).
    pub(crate) fn state_buffers(&self) -> usize {
        match self {
            Self::Adam { amsgrad, .. } => 2 + usize::from(*amsgrad),
            Self::Sgd { momentum, .. } => usize::from(momentum.is_some()),
        }
    }

    /// Names of the state buffers, in order (checkpoint files name them).
    pub(crate) fn buffer_names(&self) -> &'static [&'static str] {
        match self {
            Self::Adam { amsgrad: false, .. } => &["m", "v"],
            Self::Adam { amsgrad: true, .. } => &["m", "v", "max_v"],
            Self::Sgd { momentum: None, .. } => &[],
            Self::Sgd { .. } => &["velocity"],
        }
    }
}
