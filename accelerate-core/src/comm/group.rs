//! [`ProcessGroup`]: the typed, checked collectives API over whichever transport the group
//! formed with.

use std::time::{Duration, Instant};

use accelerate_kernels::schedule::chunk_range;
use accelerate_kernels::{Element, ReduceOp};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::call::{CallDesc, OpKind};
use super::collective::MessageEngine;
use super::engine::Engine;
use super::hierarchical::{HierarchicalEngine, Layout};
use super::link::Link;
use super::options::{GroupOptions, TransportChoice};
use super::rendezvous::{GroupSettings, RendezvousConfig};
use super::secret::JobSecret;
use super::shared_buffer::SharedBuffer;
use super::transport::local::LocalLink;
use super::transport::shm::{SegmentHooks, ShmEngine, segment_path};
use super::transport::tcp::TcpLink;
use crate::error::CommError;
use crate::state::ProcessState;

/// Largest value [`ProcessGroup::broadcast_object`] and the object gathers carry, in bytes.
pub const MAX_OBJECT_BYTES: usize = 256 << 20;

/// Largest buffer an object gather receives (every rank's value padded to the longest), in
/// bytes: one rank's large value times a large world is refused, not allocated.
pub const MAX_GATHERED_OBJECT_BYTES: usize = 1 << 30;

/// How [`ProcessGroup::all_reduce`] and [`ProcessGroup::reduce_scatter`] combine values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the number of ranks.
    Mean,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl Reduction {
    fn op(self) -> ReduceOp {
        match self {
            Reduction::Sum | Reduction::Mean => ReduceOp::Sum,
            Reduction::Max => ReduceOp::Max,
            Reduction::Min => ReduceOp::Min,
        }
    }
}

/// The ranks of a job, able to run collectives together.
///
/// Every rank must make the same calls, in the same order, with the same sizes; a rank that
/// does not gets a [`CommError::Mismatch`] naming both calls (and so do its peers), never a hang
/// or a silently wrong result. After any error the group is unusable: every later call returns
/// the first error again.
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    engine: Option<Box<dyn Engine>>,
    seq: u64,
    failed: Option<CommError>,
    /// Shared buffers allocated so far (the next one's id).
    buffers: u32,
    /// Identifies this group among the others of the process, for its shared buffers.
    tag: u64,
}

/// The message-passing engine over `link`, set up as `options` say.
fn message_engine<L: Link + 'static>(link: L, options: &GroupOptions) -> Box<dyn Engine> {
    Box::new(MessageEngine::new(
        link,
        options.timeout,
        options.algorithm,
        options.segment_bytes,
    ))
}

/// Global ranks on each host, hosts in order of their lowest rank.
fn hosts_of(peers: &[super::rendezvous::PeerInfo]) -> Vec<Vec<usize>> {
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
        use super::rendezvous::SharedMemoryHooks;
        hooks.create(token).map_err(|e| e.to_string())
    } else {
        Ok([0; 16])
    };
    let created_ok = agree(&mut setup, 0, created.is_ok())?;
    let usable = created_ok
        && agree(
            &mut setup,
            1,
            !shared || super::transport::shm::can_open(&path, hooks.world_size, hooks.slot_bytes),
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

/// Whether `ok` holds on every rank (a minimum over the set-up link).
fn agree(setup: &mut MessageEngine<TcpLink>, step: u64, ok: bool) -> Result<bool, CommError> {
    let mut call = CallDesc::new(OpKind::Setup, step);
    call.count = 1;
    call.dtype = Some(accelerate_kernels::DType::F32);
    call.reduce = Some(ReduceOp::Min);
    let mut flag = if ok { 1.0f32 } else { 0.0 }.to_le_bytes();
    setup.all_reduce(
        &call,
        &mut flag,
        accelerate_kernels::DType::F32,
        ReduceOp::Min,
        None,
    )?;
    Ok(f32::from_le_bytes(flag) == 1.0)
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

    fn with_engine(rank: usize, world_size: usize, engine: Option<Box<dyn Engine>>) -> Self {
        Self {
            rank,
            world_size,
            engine,
            seq: 0,
            failed: None,
            buffers: 0,
            tag: next_tag(),
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
        if options.transport.uses_mpi(&crate::state::ProcessEnv) {
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
        let engine = super::transport::mpi::MpiEngine::new(state, options)?;
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

    fn set_timeout(&mut self, timeout: Duration) {
        if let Some(engine) = self.engine.as_mut() {
            engine.set_timeout(timeout);
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The transport in use: "single", "local", "shm" or "tcp".
    pub fn transport(&self) -> &'static str {
        self.engine.as_ref().map_or("single", |e| e.name())
    }

    fn call(&mut self, op: OpKind) -> CallDesc {
        let call = CallDesc::new(op, self.seq);
        self.seq += 1;
        call
    }

    fn usage(&self, op: OpKind, reason: String) -> CommError {
        CommError::Usage {
            op: op.name(),
            rank: self.rank,
            reason,
        }
    }

    /// Runs `f` on the engine; the first error poisons the group and is told to the peers.
    fn run(
        &mut self,
        f: impl FnOnce(&mut dyn Engine) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        let Some(engine) = self.engine.as_mut() else {
            return Ok(());
        };
        let result = f(engine.as_mut());
        if let Err(err) = &result {
            engine.abort(err);
            self.failed = Some(err.clone());
        }
        result
    }

    /// Combines `buf` across ranks, in place, with `reduction`. Half-precision values are
    /// combined in f32 and rounded once per combination.
    pub fn all_reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        reduction: Reduction,
    ) -> Result<(), CommError> {
        let mut call = self.call(OpKind::AllReduce);
        call.count = buf.len() as u64;
        call.dtype = Some(T::DTYPE);
        call.reduce = Some(reduction.op());
        let scale = (reduction == Reduction::Mean).then(|| 1.0 / self.world_size as f32);
        self.run(|e| {
            e.all_reduce(
                &call,
                bytemuck::cast_slice_mut(buf),
                T::DTYPE,
                reduction.op(),
                scale,
            )
        })
    }

    /// Copies `root`'s `buf` into every rank's `buf`.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        let count = buf.len();
        self.broadcast_bytes(bytemuck::cast_slice_mut(buf), root, Some(T::DTYPE), count)
    }

    fn broadcast_bytes(
        &mut self,
        buf: &mut [u8],
        root: usize,
        dtype: Option<accelerate_kernels::DType>,
        count: usize,
    ) -> Result<(), CommError> {
        if root >= self.world_size {
            return Err(self.usage(
                OpKind::Broadcast,
                format!(
                    "root {root} is not a rank of a group of {}",
                    self.world_size
                ),
            ));
        }
        let mut call = self.call(OpKind::Broadcast);
        call.count = count as u64;
        call.dtype = dtype;
        call.root = Some(root as u32);
        self.run(|e| e.broadcast(&call, buf, root))
    }

    /// Concatenates every rank's `input`, in rank order, into `output`, which must be
    /// `world_size` times as long.
    pub fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        if output.len() != input.len() * self.world_size {
            return Err(self.usage(
                OpKind::AllGather,
                format!(
                    "output holds {} elements, {} x {} ranks expected",
                    output.len(),
                    input.len(),
                    self.world_size
                ),
            ));
        }
        self.all_gather_bytes(
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
            Some(T::DTYPE),
            input.len(),
        )
    }

    /// [`all_gather`](Self::all_gather) on raw bytes (any element type): every rank passes
    /// the same number of bytes.
    pub fn all_gather_raw(&mut self, input: &[u8], output: &mut [u8]) -> Result<(), CommError> {
        if output.len() != input.len() * self.world_size {
            return Err(self.usage(
                OpKind::AllGather,
                format!(
                    "output holds {} bytes, {} x {} ranks expected",
                    output.len(),
                    input.len(),
                    self.world_size
                ),
            ));
        }
        self.all_gather_bytes(input, output, None, input.len())
    }

    fn all_gather_bytes(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: Option<accelerate_kernels::DType>,
        count: usize,
    ) -> Result<(), CommError> {
        let mut call = self.call(OpKind::AllGather);
        call.count = count as u64;
        call.dtype = dtype;
        if self.engine.is_none() {
            output.copy_from_slice(input);
        }
        self.run(|e| e.all_gather(&call, input, output))
    }

    /// Reduces `input` across ranks and leaves this rank's chunk of the result in `output`:
    /// chunk `r` of `n` holds `len / n` elements, one more for the first `len % n` ranks
    /// ([`chunk_len`](Self::chunk_len) tells the size).
    pub fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        reduction: Reduction,
    ) -> Result<(), CommError> {
        let want = self.chunk_len(input.len());
        if output.len() != want {
            return Err(self.usage(
                OpKind::ReduceScatter,
                format!(
                    "output holds {} elements, this rank's chunk of {} has {want}",
                    output.len(),
                    input.len()
                ),
            ));
        }
        let mut call = self.call(OpKind::ReduceScatter);
        call.count = input.len() as u64;
        call.dtype = Some(T::DTYPE);
        call.reduce = Some(reduction.op());
        if self.engine.is_none() {
            output.copy_from_slice(input);
        }
        let n = self.world_size;
        self.run(|e| {
            let out = bytemuck::cast_slice_mut(output);
            e.reduce_scatter(
                &call,
                bytemuck::cast_slice(input),
                out,
                T::DTYPE,
                reduction.op(),
            )?;
            if reduction == Reduction::Mean {
                accelerate_kernels::reduce::scale_bytes(T::DTYPE, out, 1.0 / n as f32);
            }
            Ok(())
        })
    }

    /// Allocates a zeroed buffer of `len` elements that [`all_reduce_shared`](Self::all_reduce_shared)
    /// reduces in place: on a shared-memory group every rank reads its peers' buffers directly,
    /// with no staging copy. Every rank must call this with the same `len`.
    pub fn shared_buffer<T: Element>(&mut self, len: usize) -> Result<SharedBuffer<T>, CommError> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .filter(|&b| isize::try_from(b).is_ok())
            .ok_or_else(|| {
                self.usage(
                    OpKind::CreateBuffer,
                    format!("{len} elements do not fit in memory"),
                )
            })?;
        let id = self.buffers;
        self.buffers += 1;
        let mut call = self.call(OpKind::CreateBuffer);
        call.count = len as u64;
        call.dtype = Some(T::DTYPE);
        call.buffer = Some(id);
        let mut mapped = None;
        self.run(|e| {
            mapped = e.create_shared(&call, bytes)?;
            Ok(())
        })?;
        Ok(match mapped {
            Some(map) => SharedBuffer::mapped(map, len, id, self.tag),
            None => SharedBuffer::heap(len, id, self.tag),
        })
    }

    /// Combines `buf` across ranks, in place, with `reduction`, like
    /// [`all_reduce`](Self::all_reduce) but without staging copies on shared memory.
    pub fn all_reduce_shared<T: Element>(
        &mut self,
        buf: &mut SharedBuffer<T>,
        reduction: Reduction,
    ) -> Result<(), CommError> {
        if buf.group() != self.tag {
            return Err(self.usage(
                OpKind::AllReduceShared,
                "the buffer was allocated by another process group".into(),
            ));
        }
        let mut call = self.call(OpKind::AllReduceShared);
        call.count = buf.len() as u64;
        call.dtype = Some(T::DTYPE);
        call.reduce = Some(reduction.op());
        call.buffer = Some(buf.id());
        let scale = (reduction == Reduction::Mean).then(|| 1.0 / self.world_size as f32);
        let in_place = buf.is_shared_memory();
        self.run(|e| {
            let bytes = bytemuck::cast_slice_mut(&mut buf[..]);
            if in_place {
                e.all_reduce_shared(&call, bytes, T::DTYPE, reduction.op(), scale)
            } else {
                e.all_reduce(&call, bytes, T::DTYPE, reduction.op(), scale)
            }
        })
    }

    /// Elements of this rank's chunk when `len` elements are scattered.
    pub fn chunk_len(&self, len: usize) -> usize {
        chunk_range(len, self.world_size, self.rank).len()
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<(), CommError> {
        let call = self.call(OpKind::Barrier);
        self.run(|e| e.barrier(&call))
    }

    /// `root`'s value on every rank. `value` is required on the root and ignored elsewhere.
    /// Meant for small values (configurations, counters): it travels as JSON.
    pub fn broadcast_object<V: Serialize + DeserializeOwned>(
        &mut self,
        value: Option<&V>,
        root: usize,
    ) -> Result<V, CommError> {
        let mut bytes = if self.rank == root {
            let value = value.ok_or_else(|| {
                self.usage(OpKind::Broadcast, "the root must pass a value".into())
            })?;
            serde_json::to_vec(value).map_err(|e| self.usage(OpKind::Broadcast, e.to_string()))?
        } else {
            Vec::new()
        };
        let mut len = (bytes.len() as u64).to_le_bytes();
        self.broadcast_bytes(&mut len, root, None, 8)?;
        let len = self.object_len(OpKind::Broadcast, root, u64::from_le_bytes(len))?;
        bytes.resize(len, 0);
        let n = bytes.len();
        self.broadcast_bytes(&mut bytes, root, None, n)?;
        serde_json::from_slice(&bytes).map_err(|e| {
            self.usage(
                OpKind::Broadcast,
                format!("the value from rank {root} does not decode: {e}"),
            )
        })
    }

    /// Checks the length of a serialized object announced by `from`: objects are small
    /// values, and a length no honest rank sends is an error, not an allocation.
    fn object_len(&self, op: OpKind, from: usize, len: u64) -> Result<usize, CommError> {
        usize::try_from(len)
            .ok()
            .filter(|&len| len <= MAX_OBJECT_BYTES)
            .ok_or_else(|| {
                self.usage(
                    op,
                    format!(
                        "rank {from} announced a value of {len} bytes; objects are limited to \
                         {MAX_OBJECT_BYTES} bytes (use the typed collectives for tensors)"
                    ),
                )
            })
    }

    /// Every rank's value, in rank order, on `root` (`None` elsewhere). Meant for small
    /// values: it travels as JSON.
    pub fn gather_object<V: Serialize + DeserializeOwned>(
        &mut self,
        value: &V,
        root: usize,
    ) -> Result<Option<Vec<V>>, CommError> {
        if root >= self.world_size {
            return Err(self.usage(
                OpKind::AllGather,
                format!(
                    "root {root} is not a rank of a group of {}",
                    self.world_size
                ),
            ));
        }
        let all = self.all_gather_object(value)?;
        Ok((self.rank == root).then_some(all))
    }

    /// Every rank's value, in rank order, on every rank. Meant for small values: it travels
    /// as JSON.
    pub fn all_gather_object<V: Serialize + DeserializeOwned>(
        &mut self,
        value: &V,
    ) -> Result<Vec<V>, CommError> {
        let mut bytes =
            serde_json::to_vec(value).map_err(|e| self.usage(OpKind::AllGather, e.to_string()))?;
        let n = self.world_size;
        let mut lens = vec![0u8; 8 * n];
        self.all_gather_bytes(&(bytes.len() as u64).to_le_bytes(), &mut lens, None, 8)?;
        let lens: Vec<usize> = lens
            .chunks_exact(8)
            .enumerate()
            .map(|(r, c)| {
                let len = u64::from_le_bytes(c.try_into().unwrap_or_default());
                self.object_len(OpKind::AllGather, r, len)
            })
            .collect::<Result<_, _>>()?;
        let (longest_rank, longest) = lens
            .iter()
            .copied()
            .enumerate()
            .max_by_key(|&(_, len)| len)
            .unwrap_or((0, 0));
        bytes.resize(longest, 0);
        let total = longest
            .checked_mul(n)
            .filter(|&total| total <= MAX_GATHERED_OBJECT_BYTES)
            .ok_or_else(|| {
                self.usage(
                    OpKind::AllGather,
                    format!(
                        "rank {longest_rank}'s value of {longest} bytes, padded for each of {n} \
                         ranks, exceeds the {MAX_GATHERED_OBJECT_BYTES} bytes an object gather \
                         receives (gather smaller values, or use the typed collectives)"
                    ),
                )
            })?;
        let mut all = vec![0u8; total];
        self.all_gather_bytes(&bytes, &mut all, None, longest)?;
        lens.iter()
            .enumerate()
            .map(|(r, &len)| {
                serde_json::from_slice(&all[r * longest..r * longest + len]).map_err(|e| {
                    self.usage(
                        OpKind::AllGather,
                        format!("the value from rank {r} does not decode: {e}"),
                    )
                })
            })
            .collect::<Result<Vec<V>, _>>()
    }
}
