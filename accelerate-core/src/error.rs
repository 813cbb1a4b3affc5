//! The errors of `accelerate-core`: one enum per concern, each message one line that names
//! the variable or key at fault and what would fix it.

use crate::state::Launcher;

/// The launcher environment could not describe this process.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// A variable is set to a value that cannot be right.
    #[error("{var} = {value}: {why}")]
    Invalid {
        /// The environment variable.
        var: &'static str,
        /// Its value as found.
        value: String,
        /// What is wrong with it.
        why: String,
    },
    /// A variable the launcher should have set is missing.
    #[error("{var} is not set (launcher: {launcher}): {why}")]
    Missing {
        /// The environment variable (or the pair, for either-or variables).
        var: &'static str,
        /// The launcher whose other variables were found.
        launcher: Launcher,
        /// Why it is needed.
        why: &'static str,
    },
}

impl StateError {
    pub(crate) fn invalid(
        var: &'static str,
        value: impl ToString,
        why: impl Into<String>,
    ) -> Self {
        Self::Invalid {
            var,
            value: value.to_string(),
            why: why.into(),
        }
    }
}

/// A configuration value could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A value from some source (code, env, file) is out of range or unparsable.
    #[error("{key} ({source_name}) = {value}: expected {expected}")]
    Invalid {
        /// Name of the key or variable.
        key: &'static str,
        /// Where it came from: "code", "env", or a file path.
        source_name: String,
        /// The value as found.
        value: String,
        /// What would have been accepted.
        expected: &'static str,
    },
}
