//! Gradients averaged where they live, with NCCL, on the cuda backend (feature `nccl`).
//!
//! At build the accelerator decides, the same on every rank, whether the job uses NCCL
//! ([`plan`], then `accelerate_core::nccl::agree`); if so every rank joins one communicator
//! and the reducers hand their device buffers to [`DeviceCollectives`] instead of copying
//! them to the host. Without the feature (or on another backend) `DeviceCollectives` cannot
//! exist, so every reducer keeps its host path and no `cfg` reaches their code.

#[cfg(feature = "nccl")]
mod device;

use accelerate_core::NcclMode;
use accelerate_core::comm::ProcessGroup;

use crate::error::AccelerateError;
#[cfg(not(feature = "nccl"))]
use accelerate_core::MixedPrecision;
#[cfg(not(feature = "nccl"))]
use burn::tensor::Tensor;

/// What a process does about NCCL before talking to the others.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Not a question for this job: the host path, silently (`debug` says why).
    Skip(&'static str),
    /// The host path, and the main process says once how NCCL could be had.
    Hint(&'static str),
    /// Ask every rank (`accelerate_core::nccl::agree`).
    Agree,
    /// The user required NCCL and this build or backend cannot have it.
    Refuse(&'static str),
}

/// The first decision, from what this process knows alone: its `backend`, whether the build
/// has the `nccl` feature, the world size and the mode. One process under `auto` skips NCCL
/// (there is nothing to average); `require` uses it even then, which is how one GPU exercises
/// the path.
pub(crate) fn plan(backend: &str, compiled: bool, world: usize, mode: NcclMode) -> Plan {
    match mode {
        NcclMode::Off => Plan::Skip("ACCELERATE_NCCL=off"),
        _ if backend != "cuda" => match mode {
            NcclMode::Require => Plan::Refuse(
                "NCCL needs the cuda backend, and this process trains on another (build with \
                 --features nccl on a machine with NVIDIA GPUs)",
            ),
            _ => Plan::Skip("not the cuda backend"),
        },
        _ if !compiled => match mode {
            NcclMode::Require => {
                Plan::Refuse("this build has no `nccl` feature (rebuild with --features nccl)")
            }
            _ if world > 1 => Plan::Hint(
                "the cuda backend averages gradients on the host in this build; build with \
                 --features nccl to average them on the GPUs with NCCL",
            ),
            _ => Plan::Skip("one process, no `nccl` feature"),
        },
        NcclMode::Auto if world == 1 => Plan::Skip("one process: nothing to average"),
        _ => Plan::Agree,
    }
}

/// Decides for this job and, when it uses NCCL, joins the communicator on the GPU of
/// `local_rank`. Every rank calls it at build, in the same order as its other collectives.
pub(crate) fn connect(
    group: &mut ProcessGroup,
    backend: &'static str,
    mode: NcclMode,
    local_rank: usize,
    timeout: std::time::Duration,
) -> Result<Option<DeviceCollectives>, AccelerateError> {
    let rank = group.rank();
    match plan(backend, cfg!(feature = "nccl"), group.world_size(), mode) {
        Plan::Skip(reason) => {
            tracing::debug!("gradients are averaged on the host: {reason}");
            Ok(None)
        }
        Plan::Hint(hint) => {
            if rank == 0 {
                tracing::info!("{hint}");
            }
            Ok(None)
        }
        Plan::Refuse(reason) => Err(AccelerateError::Misuse {
            rank,
            what: format!("ACCELERATE_NCCL=require (or strict_nccl): {reason}"),
            hint: "unset ACCELERATE_NCCL (or drop strict_nccl) to average gradients on the host",
        }),
        Plan::Agree => DeviceCollectives::join(group, mode, local_rank, timeout),
    }
}

/// NCCL's collectives on this process's GPU, shared by the accelerator's reducers.
#[cfg(feature = "nccl")]
#[derive(Clone)]
pub(crate) struct DeviceCollectives(std::sync::Arc<std::sync::Mutex<device::DeviceNccl>>);

/// NCCL's collectives on this process's GPU: none in a build without the `nccl` feature.
#[cfg(not(feature = "nccl"))]
#[derive(Clone)]
pub(crate) enum DeviceCollectives {}

#[cfg(not(feature = "nccl"))]
impl DeviceCollectives {
    fn join(
        _: &mut ProcessGroup,
        _: NcclMode,
        _: usize,
        _: std::time::Duration,
    ) -> Result<Option<Self>, AccelerateError> {
        Ok(None)
    }

    /// See the `nccl` build's.
    pub fn all_reduce_mean(
        &self,
        _: Tensor<1>,
        _: MixedPrecision,
    ) -> Result<Tensor<1>, AccelerateError> {
        match *self {}
    }

    /// See the `nccl` build's.
    pub fn all_reduce(
        &self,
        _: Tensor<1>,
        _: accelerate_core::comm::Reduction,
        _: MixedPrecision,
    ) -> Result<Tensor<1>, AccelerateError> {
        match *self {}
    }

    /// See the `nccl` build's.
    #[cfg_attr(not(feature = "device-kernels"), allow(dead_code))]
    pub fn reduce_scatter_mean(
        &self,
        _: Tensor<1>,
        _: usize,
        _: MixedPrecision,
    ) -> Result<Tensor<1>, AccelerateError> {
        match *self {}
    }

    /// See the `nccl` build's.
    #[cfg_attr(not(feature = "device-kernels"), allow(dead_code))]
    pub fn all_gather(&self, _: Tensor<1>) -> Result<Tensor<1>, AccelerateError> {
        match *self {}
    }

    /// See the `nccl` build's.
    #[cfg(feature = "device-kernels")]
    pub fn gather_shard(
        &self,
        _: burn_cubecl::tensor::CubeTensor,
    ) -> Result<burn_cubecl::tensor::CubeTensor, std::convert::Infallible> {
        match *self {}
    }

    /// See the `nccl` build's.
    #[cfg(feature = "device-kernels")]
    pub fn reduce_scatter_shard(
        &self,
        _: burn_cubecl::tensor::CubeTensor,
        _: usize,
    ) -> Result<burn_cubecl::tensor::CubeTensor, std::convert::Infallible> {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_is_asked_for_only_where_it_can_help_or_was_required() {
        use NcclMode::{Auto, Off, Require};
        assert_eq!(plan("cuda", true, 2, Auto), Plan::Agree);
        assert_eq!(plan("cuda", true, 1, Require), Plan::Agree);
        assert!(matches!(plan("cuda", true, 1, Auto), Plan::Skip(_)));
        assert!(matches!(plan("cuda", true, 8, Off), Plan::Skip(_)));
        assert!(matches!(plan("flex", false, 4, Auto), Plan::Skip(_)));
        assert!(
            matches!(plan("wgpu", true, 4, Require), Plan::Refuse(r) if r.contains("cuda backend"))
        );
        assert!(
            matches!(plan("cuda", false, 2, Auto), Plan::Hint(h) if h.contains("--features nccl"))
        );
        assert!(
            matches!(plan("cuda", false, 2, Require), Plan::Refuse(r) if r.contains("`nccl` feature"))
        );
    }

    #[test]
    fn requiring_nccl_on_this_build_is_an_error_naming_the_rank() {
        let mut group = ProcessGroup::single();
        let timeout = std::time::Duration::from_secs(1);
        let err = connect(&mut group, "flex", NcclMode::Require, 0, timeout)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("rank 0") && err.contains("ACCELERATE_NCCL=require"),
            "{err}"
        );
        assert!(connect(&mut group, "flex", NcclMode::Auto, 0, timeout).is_ok_and(|c| c.is_none()));
    }
}
