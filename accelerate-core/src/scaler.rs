//! `DynamicLossScaler`: the state machine of fp16 dynamic loss scaling, without tensors.
//!
//! The loss is multiplied by the scale before backward so that small fp16 gradients do not
//! flush to zero; gradients are divided by it afterwards. A step whose gradients overflowed
//! is skipped and the scale backs off; after `growth_interval` clean steps in a row the scale
//! grows. Defaults are PyTorch's `GradScaler` (65,536, x2, x0.5, 2,000), plus a floor
//! (`min_scale`, DeepSpeed's default of 1) so that repeated overflows cannot drive the scale to
//! zero. Every rank must feed the same overflow decision (the OR over ranks), so that all skip
//! the same steps and their scales stay equal.

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// How the scale moves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScalerConfig {
    /// Scale of the first step (default 65,536).
    pub init_scale: f32,
    /// Multiplier after `growth_interval` clean steps in a row (default 2).
    pub growth_factor: f32,
    /// Multiplier after an overflow (default 0.5).
    pub backoff_factor: f32,
    /// Clean steps in a row before the scale grows (default 2,000).
    pub growth_interval: u32,
    /// The scale never backs off below this (default 1).
    pub min_scale: f32,
}

impl Default for ScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65_536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2_000,
            min_scale: 1.0,
        }
    }
}

impl ScalerConfig {
    fn invalid(key: &'static str, value: impl ToString, expected: &'static str) -> ConfigError {
        ConfigError::Invalid {
            key,
            source_name: "code".into(),
            value: value.to_string(),
            expected,
        }
    }

    /// Checks the values; errors name the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = |v: f32| v.is_finite() && v > 0.0;
        if !positive(self.init_scale) {
            return Err(Self::invalid(
                "init_scale",
                self.init_scale,
                "a positive finite number",
            ));
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return Err(Self::invalid(
                "growth_factor",
                self.growth_factor,
                "a number above 1",
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return Err(Self::invalid(
                "backoff_factor",
                self.backoff_factor,
                "a number between 0 and 1",
            ));
        }
        if self.growth_interval == 0 {
            return Err(Self::invalid("growth_interval", 0, "at least 1"));
        }
        if !positive(self.min_scale) || self.min_scale > self.init_scale {
            return Err(Self::invalid(
                "min_scale",
                self.min_scale,
                "a positive number not above init_scale",
            ));
        }
        Ok(())
    }
}

/// What the optimizer does with the current gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaledStep {
    /// Gradients are finite: step.
    Step,
    /// Some gradient overflowed (on some rank): skip, the scale backed off.
    Skip,
}

/// The part of a scaler that a checkpoint stores.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The current scale.
    pub scale: f32,
    /// Clean steps in a row since the last change of scale.
    pub growth_tracker: u32,
    /// Steps skipped so far.
    pub skipped: u64,
}

/// The dynamic loss scaler of one training run.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicLossScaler {
    config: ScalerConfig,
    state: ScalerState,
}

impl DynamicLossScaler {
    /// A scaler starting at `config.init_scale`.
    pub fn new(config: ScalerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            state: ScalerState {
                scale: config.init_scale,
                growth_tracker: 0,
                skipped: 0,
            },
            config,
        })
    }

    /// The scale the next loss is multiplied by.
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    /// The factor gradients are multiplied by to undo the scale.
    pub fn inv_scale(&self) -> f32 {
        1.0 / self.state.scale
    }

    /// Records the outcome of a step: `found_non_finite` must be the same on every rank.
    pub fn update(&mut self, found_non_finite: bool) -> ScaledStep {
        let s = &mut self.state;
        if found_non_finite {
            s.scale = (s.scale * self.config.backoff_factor).max(self.config.min_scale);
            s.growth_tracker = 0;
            s.skipped += 1;
            return ScaledStep::Skip;
        }
        s.growth_tracker += 1;
        if s.growth_tracker >= self.config.growth_interval {
            let grown = s.scale * self.config.growth_factor;
            // Like PyTorch, never grow into infinity.
            if grown.is_finite() {
                s.scale = grown;
            }
            s.growth_tracker = 0;
        }
        ScaledStep::Step
    }

    /// The state to checkpoint.
    pub fn state(&self) -> ScalerState {
        self.state
    }

    /// Continues from a checkpointed state.
    pub fn load_state(&mut self, state: ScalerState) {
        self.state = state;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler(growth_interval: u32) -> DynamicLossScaler {
        DynamicLossScaler::new(ScalerConfig {
            growth_interval,
            ..ScalerConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn defaults_are_pytorchs() {
        let s = DynamicLossScaler::new(ScalerConfig::default()).unwrap();
        assert_eq!(s.scale(), 65_536.0);
        assert_eq!(s.inv_scale(), 1.0 / 65_536.0);
        assert_eq!(ScalerConfig::default().growth_interval, 2_000);
    }

    #[test]
    fn the_scale_grows_after_the_interval_of_clean_steps() {
        let mut s = scaler(3);
        assert_eq!(s.update(false), ScaledStep::Step);
        assert_eq!(s.update(false), ScaledStep::Step);
        assert_eq!(s.scale(), 65_536.0);
        assert_eq!(s.update(false), ScaledStep::Step);
        assert_eq!(s.scale(), 131_072.0);
        assert_eq!(s.state().growth_tracker, 0);
    }

    #[test]
    fn an_overflow_skips_backs_off_and_restarts_the_interval() {
        let mut s = scaler(3);
        s.update(false);
        s.update(false);
        assert_eq!(s.update(true), ScaledStep::Skip);
        assert_eq!(s.scale(), 32_768.0);
        assert_eq!(s.state().skipped, 1);
        // Two clean steps are not enough any more: the interval restarted.
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 32_768.0);
        s.update(false);
        assert_eq!(s.scale(), 65_536.0);
    }

    #[test]
    fn the_scale_never_falls_below_the_minimum_nor_grows_to_infinity() {
        let mut s = DynamicLossScaler::new(ScalerConfig {
            init_scale: 4.0,
            min_scale: 1.0,
            ..ScalerConfig::default()
        })
        .unwrap();
        for _ in 0..10 {
            assert_eq!(s.update(true), ScaledStep::Skip);
        }
        assert_eq!(s.scale(), 1.0);
        let mut s = DynamicLossScaler::new(ScalerConfig {
            init_scale: f32::MAX / 1.5,
            growth_interval: 1,
            ..ScalerConfig::default()
        })
        .unwrap();
        s.update(false);
        assert!(s.scale().is_finite());
    }

    #[test]
    fn state_round_trips_through_serde() {
        let mut s = scaler(5);
        s.update(false);
        s.update(true);
        s.update(false);
        let json = serde_json::to_string(&s.state()).unwrap();
        let mut t = scaler(5);
        t.load_state(serde_json::from_str(&json).unwrap());
        assert_eq!(s, t);
        assert_eq!(s.update(false), t.update(false));
        assert_eq!(s.state(), t.state());
    }

    #[test]
    fn bad_settings_name_the_key() {
        let bad = |c: ScalerConfig| DynamicLossScaler::new(c).unwrap_err().to_string();
        let d = ScalerConfig::default;
        assert!(
            bad(ScalerConfig {
                growth_factor: 1.0,
                ..d()
            })
            .starts_with("growth_factor (code) = 1")
        );
        assert!(
            bad(ScalerConfig {
                backoff_factor: 1.5,
                ..d()
            })
            .starts_with("backoff_factor")
        );
        assert!(
            bad(ScalerConfig {
                growth_interval: 0,
                ..d()
            })
            .starts_with("growth_interval")
        );
        assert!(
            bad(ScalerConfig {
                init_scale: f32::NAN,
                ..d()
            })
            .starts_with("init_scale")
        );
        assert!(
            bad(ScalerConfig {
                min_scale: 1e9,
                ..d()
            })
            .starts_with("min_scale")
        );
    }
}
