//! Forming a [`ProcessGroup`]: the rendezvous, then the engine it allows: shared memory when
//! every rank is on one host, TCP (flat, or hierarchical when hosts hold several ranks), MPI
//! under an MPI launcher, or channels between the threads of one process.

use std::sync::Arc;
use std::time::Instant;

use super::ProcessGroup;
use super::alarm::JobAlarm;
use crate::comm::call::{CallDesc, OpKind};
use crate::comm::collective::MessageEngine;
use crate::comm::engine::{Engine, all_agree};
use crate::comm::hierarchical::{HierarchicalEngine, Layout};
use crate::comm::link::Link;
use crate::comm::options::{GroupOptions, TransportChoice};
use crate::comm::rendezvous::secret::JobSecret;
use crate::comm::rendezvous::{GroupSettings, PeerInfo, RendezvousConfig, SharedMemoryHooks};
use crate::comm::sub_link::SubLink;
use crate::comm::transport::local::LocalLink;
use crate::comm::transport::shm::{SegmentHooks, ShmEngine, segment_path};
use crate::comm::transport::tcp::TcpLink;
use crate::error::CommError;
use crate::state::ProcessState;

/// The message-passing engine over `link`, set up as `options` say (shared, so that groups
/// split from it reuse its connections).
fn message_engine<L: Link + 'static>(link: L, options: &GroupOptions) -> Box<dyn Engine> {
    Box::new(MessageEngine::new(
        SubLink::whole(link),
        options.timeout,
        options.algorithm,
        options.segment_bytes,
    ))
}

/// Global ranks on each host, hosts in order of their lowest rank.
fn hosts_of(peers: &[PeerInfo]) -> Vec<Vec<usize>> {
    let mut hosts: Vec<(String, Vec<usize>)> = Vec::new();
    for peer in peers {
        match hosts.iter_mut().find(|(h, _)| *h == peer.host) {
            Some((_, ranks)) => ranks.push(peer.rank),
            None => hosts.push((peer.host.clone(), vec![peer.rank])),
        }
    }
    hosts.into_iter().map(|(_, ranks)| ranks).collect()
}

/// Shared memory inside this host (its leader creates the segment; everyone waits at a TCP
/// barrier until every leader has), TCP among leaders.
fn hierarchical_engine(
    link: TcpLink,
    hosts: Vec<Vec<usize>>,
    rank: usize,
    token: &[u8],
    addr: &str,
    options: &GroupOptions,
) -> Result<Box<dyn Engine>, CommError> {
    let mine = hosts
        .iter()
        .find(|h| h.contains(&rank))
        .cloned()
        .unwrap_or_else(|| vec![rank]);
    let local_index = mine.iter().position(|&r| r == rank).unwrap_or(0);
    let hooks = SegmentHooks {
        addr: format!("{addr}/host-of-{}", mine[0]),
        world_size: mine.len(),
        slot_bytes: options.shm_slot_bytes,
        rank,
    };
    let path = segment_path(token, &hooks.addr);
    let shared = mine.len() > 1;
    let mut setup = MessageEngine::new(
        link,
        options.rendezvous_timeout,
        options.algorithm,
        options.segment_bytes,
    );
    // Every host's leader creates its segment, every rank checks it can open its host's, and
    // all agree: one host without usable shared memory (a full /dev/shm, a container's own)
    // makes the whole group all-reduce flat over TCP, with one warning.
    let created = if shared && local_index == 0 {
        hooks.create(token).map_err(|e| e.to_string())
    } else {
        Ok([0; 16])
    };
    let created_ok = all_agree(&mut setup, CallDesc::new(OpKind::Setup, 0), created.is_ok())?;
    let usable = created_ok
        && all_agree(
            &mut setup,
            CallDesc::new(OpKind::Setup, 1),
            !shared
                || crate::comm::transport::shm::can_open(&path, hooks.world_size, hooks.slot_bytes),
        )?;
    if !usable {
        if shared && local_index == 0 {
            let _ = std::fs::remove_file(&path);
        }
        if let Err(why) = created {
            tracing::warn!(
                "shared memory unavailable on this host ({why}); all-reduces run flat over TCP"
            );
        }
        return Ok(message_engine(setup.into_link(), options));
    }
    let local = if shared {
        Some(ShmEngine::open(
            &path,
            local_index,
            mine.len(),
            options.shm_slot_bytes,
            options.rendezvous_timeout,
        )?)
    } else {
        None
    };
    Ok(Box::new(HierarchicalEngine::new(
        setup.into_link(),
        &Layout { hosts, rank },
        local,
        options.timeout,
        options.algorithm,
        options.segment_bytes,
    )))
}

/// A process-unique tag for a new group.
fn next_tag() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl ProcessGroup {
    /// The group of a single process: every collective returns its input.
    pub fn single() -> Self {
        Self::with_engine(0, 1, None)
    }

    pub(super) fn with_engine(
        rank: usize,
        world_size: usize,
        engine: Option<Box<dyn Engine>>,
    ) -> Self {
        Self::with_engine_in(rank, world_size, engine, Arc::new(JobAlarm::default()))
    }

    /// A group of the job whose groups in this process share `alarm` (a new job's own, or
    /// the job's it is split from).
    pub(super) fn with_engine_in(
        rank: usize,
        world_size: usize,
        engine: Option<Box<dyn Engine>>,
        alarm: Arc<JobAlarm>,
    ) -> Self {
        let tag = next_tag();
        alarm.join(tag, engine.as_ref().and_then(|e| e.abort_notice()));
        Self {
            rank,
            world_size,
            engine,
            seq: 0,
            failed: None,
            buffers: 0,
            tag,
            members: None,
            alarm,
        }
    }

    /// Forms the group described by `state`: rendezvous at its master address, then shared
    /// memory when every rank is on this host (unless `options` say otherwise), else TCP.
    /// Under an MPI launcher, in a build with the `mpi` feature (or with
    /// `ACCELERATE_TRANSPORT=mpi`), the group is MPI's instead, with no rendezvous of ours.
    pub fn new(state: &ProcessState, options: &GroupOptions) -> Result<Self, CommError> {
        if state.world_size == 1 {
            return Ok(Self::single());
        }
        if options.transport.uses_mpi(&crate::env_vars::ProcessEnv) {
            return Self::over_mpi(state, options);
        }
        let (rank, world_size) = (state.rank, state.world_size);
        let host = state
            .master_addr
            .clone()
            .ok_or_else(|| CommError::Rendezvous {
                addr: "(none)".into(),
                rank,
                world_size,
                reason: "MASTER_ADDR is not set".into(),
            })?;
        let addr = format!("{host}:{}", state.master_port);
        let secret = match &state.agent_store {
            // torchrun across hosts: rank 0's address goes through torchrun's store.
            Some(store) if state.local_world_size < world_size => JobSecret::through_store(
                options.token.as_deref(),
                world_size.div_ceil(state.local_world_size),
                store,
                format!(
                    "accelerate-rs/{}/rendezvous",
                    state.job_id.as_deref().unwrap_or("job")
                ),
                crate::wait::deadline_after(options.rendezvous_timeout),
            ),
            _ => JobSecret::resolve(
                options.token.as_deref(),
                &host,
                state.master_port,
                (state.local_world_size, world_size),
                state.job_id.as_deref(),
            ),
        }
        .map_err(|e| CommError::Rendezvous {
            addr: addr.clone(),
            rank,
            world_size,
            reason: e.to_string(),
        })?;
        let rendezvous = RendezvousConfig {
            addr: addr.clone(),
            rank,
            world_size,
            secret,
            timeout: options.rendezvous_timeout,
            allow_shared_memory: options.transport != TransportChoice::Tcp,
            require_shared_memory: options.transport == TransportChoice::Shm,
            settings: GroupSettings {
                shm_slot_bytes: options.shm_slot_bytes as u64,
                segment_bytes: options.segment_bytes as u64,
            },
        };
        let started = Instant::now();
        let hooks = SegmentHooks {
            addr: addr.clone(),
            world_size,
            slot_bytes: options.shm_slot_bytes,
            rank,
        };
        let joined = rendezvous.join(&hooks)?;
        let engine: Box<dyn Engine> = if joined.shared_memory {
            Box::new(ShmEngine::open(
                &segment_path(&joined.token, &addr),
                rank,
                world_size,
                options.shm_slot_bytes,
                options.rendezvous_timeout,
            )?)
        } else {
            let deadline = started + options.rendezvous_timeout;
            let link = TcpLink::connect(
                rank,
                &joined.peers,
                &joined.listener,
                &joined.token,
                deadline,
                options.heartbeat_timeout,
            )?;
            let hosts = hosts_of(&joined.peers);
            if options.hierarchical
                && options.transport == TransportChoice::Auto
                && hosts.len() > 1
                && hosts.iter().any(|h| h.len() > 1)
            {
                hierarchical_engine(link, hosts, rank, &joined.token, &addr, options)?
            } else {
                message_engine(link, options)
            }
        };
        tracing::info!(rank, world_size, transport = engine.name(), %addr, "process group formed");
        let mut group = Self::with_engine(rank, world_size, Some(engine));
        // The shared-memory engine used the rendezvous timeout for set-up; collectives use theirs.
        group.set_timeout(options.timeout);
        Ok(group)
    }

    /// The group MPI formed (the `mpi` feature).
    #[cfg(feature = "mpi")]
    fn over_mpi(state: &ProcessState, options: &GroupOptions) -> Result<Self, CommError> {
        let engine = crate::comm::transport::mpi::MpiEngine::new(state, options)?;
        tracing::info!(
            rank = state.rank,
            world_size = state.world_size,
            transport = "mpi",
            "process group formed"
        );
        Ok(Self::with_engine(
            state.rank,
            state.world_size,
            Some(Box::new(engine)),
        ))
    }

    /// Without the `mpi` feature, asking for MPI is an error that says how to get it.
    #[cfg(not(feature = "mpi"))]
    fn over_mpi(state: &ProcessState, _options: &GroupOptions) -> Result<Self, CommError> {
        Err(CommError::Usage {
            op: "setup",
            rank: state.rank,
            reason: "ACCELERATE_TRANSPORT=mpi, but this program was built without the `mpi` \
                     feature. hint: build with --features mpi (needs libopenmpi-dev and \
                     libclang-dev), or use ACCELERATE_TRANSPORT=auto"
                .into(),
        })
    }

    /// A group of `world_size` ranks in this process, one per thread, over channels.
    pub fn local(world_size: usize, options: &GroupOptions) -> Vec<ProcessGroup> {
        if world_size <= 1 {
            return vec![Self::single()];
        }
        LocalLink::group(world_size)
            .into_iter()
            .enumerate()
            .map(|(rank, link)| {
                Self::with_engine(rank, world_size, Some(message_engine(link, options)))
            })
            .collect()
    }
}
