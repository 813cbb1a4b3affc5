//! Typed reads of launcher variables, shared by the readers of each launcher: a number that
//! does not parse, or one the launcher should have set, is an error naming the variable.

use super::contract::{DEFAULT_MASTER_PORT, MASTER_ADDR, MASTER_PORT};
use super::launcher::Launcher;
use crate::env_vars::EnvSource;
use crate::error::StateError;

/// Typed reads of launcher variables.
pub(super) struct Reader<'a, E: EnvSource + ?Sized> {
    pub(super) env: &'a E,
}

impl<E: EnvSource + ?Sized> Reader<'_, E> {
    pub(super) fn usize_opt(&self, var: &'static str) -> Result<Option<usize>, StateError> {
        self.env
            .var(var)
            .map(|v| {
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| StateError::invalid(var, &v, "expected a non-negative integer"))
            })
            .transpose()
    }

    pub(super) fn usize_req(
        &self,
        var: &'static str,
        launcher: Launcher,
    ) -> Result<usize, StateError> {
        self.usize_opt(var)?.ok_or(StateError::Missing {
            var,
            launcher,
            why: "the launcher's other variables are set, so this one must be too",
        })
    }

    /// The first of `vars` that is set.
    pub(super) fn first_usize(&self, vars: &[&'static str]) -> Result<Option<usize>, StateError> {
        for var in vars {
            if let Some(v) = self.usize_opt(var)? {
                return Ok(Some(v));
            }
        }
        Ok(None)
    }

    pub(super) fn master(&self) -> Result<(Option<String>, u16), StateError> {
        let addr = self.env.var(MASTER_ADDR).map(|a| a.trim().to_string());
        let port = match self.env.var(MASTER_PORT) {
            None => DEFAULT_MASTER_PORT,
            Some(v) => v.trim().parse::<u16>().map_err(|_| {
                StateError::invalid(MASTER_PORT, &v, "expected a port number (0-65535)")
            })?,
        };
        Ok((addr, port))
    }

    /// Where rank 0's store is: `MASTER_ADDR`/`MASTER_PORT` when set; for a job on one host
    /// that its launcher names, without `MASTER_ADDR`, loopback and a port rank 0 picks (0);
    /// else `MASTER_ADDR` unset (an error later, with a hint).
    pub(super) fn master_or_local(
        &self,
        one_host: bool,
        job_id: &Option<String>,
    ) -> Result<(Option<String>, u16), StateError> {
        let (addr, port) = self.master()?;
        if addr.is_none() && one_host && job_id.is_some() {
            let port = if self.env.var(MASTER_PORT).is_some() {
                port
            } else {
                0
            };
            return Ok((Some("127.0.0.1".into()), port));
        }
        Ok((addr, port))
    }
}
