//! [`NcclComm`]: the [`Communicator`] trait over NCCL (feature `cuda`).
//!
//! Buffers stay on the host (`&[f32]`, as for [`super::ThreadComm`]): each operation
//! uploads them to device memory, runs the NCCL collective on a dedicated
//! communication stream, downloads the result and synchronises that stream. That
//! staging costs two PCIe copies per call; it lets the CPU interpreter run over real
//! GPUs unchanged, and the CUDA interpreter will call NCCL on its own device buffers.
//!
//! Sub-communicators: a [`Group`] other than the world in rank order gets its own
//! NCCL communicator on first use, created by its members only. The group's first
//! rank makes a unique id and sends its 128 bytes to the other members over the
//! world communicator (NCCL send/recv), then every member calls
//! `ncclCommInitRank` with its index in the group. This works the same for one
//! process per GPU and for one process driving several GPUs, and needs no
//! collective over non-members (which `ncclCommSplit` would).
//!
//! All-to-All and All-to-All-v are grouped send/recv pairs (`ncclGroupStart` /
//! `ncclGroupEnd`); send/recv for pipeline p2p use the world communicator with global
//! ranks; barrier is a one-element all-reduce on the group's communicator.
//!
//! Byte counts are recorded exactly as [`super::ThreadComm`] records them (payload
//! and `ring_bytes`), so `--check`'s comparison against the plan applies unchanged.
//! Unlike `ThreadComm`, NCCL does not detect mismatched calls or time out: a
//! mismatch hangs or corrupts, so validate a program with `ThreadComm` first.
//!
//! NCCL is loaded at run time by cudarc, which looks for the names of
//! [`nccl_library_candidates`] — `libnccl.so`, `libnccl.so.13`/`.12`/.../`.1` and
//! Windows-style `libnccl64_*.so` — but not `libnccl.so.2`, the only name an NCCL
//! 2.x install (or pip's `nvidia-nccl-cu12/13`) ships. [`nccl_available`] checks
//! before any cudarc NCCL call and says what to do: a `libnccl.so` symlink to
//! `libnccl.so.2` in a folder on `LD_LIBRARY_PATH`.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt;
use std::sync::{Arc, Mutex};

use meshplan_kernels::cuda::bf16;
use meshplan_kernels::cuda::cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop,
};
use meshplan_kernels::cuda::cudarc::nccl::{result, sys};

use super::args;
use super::counts::ring_bytes;
use super::{ByteCounts, CommError, CommKind, Communicator, Group};
use crate::launch::{LaunchEnv, Rendezvous};

/// Why an NCCL communicator could not be created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclError {
    /// What failed, with what to do where known.
    pub detail: String,
}

impl fmt::Display for NcclError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

impl std::error::Error for NcclError {}

fn err(detail: impl Into<String>) -> NcclError {
    NcclError {
        detail: detail.into(),
    }
}

/// The file names cudarc (0.19, dynamic loading) tries, in order, for NCCL.
pub fn nccl_library_candidates() -> Vec<String> {
    meshplan_kernels::cuda::cudarc::get_lib_name_candidates("nccl")
}

/// What to do when NCCL cannot be loaded.
pub fn nccl_missing_message() -> String {
    format!(
        "libnccl cannot be loaded. cudarc looks for exactly these names: {}. An NCCL 2.x \
         install (system package, or pip's nvidia-nccl-cu13 under \
         site-packages/nvidia/nccl/lib) ships only `libnccl.so.2`, which is not among them. \
         Fix: `mkdir -p /tmp/nccl-lib && ln -sf /path/to/libnccl.so.2 \
         /tmp/nccl-lib/libnccl.so && export LD_LIBRARY_PATH=/tmp/nccl-lib:$LD_LIBRARY_PATH` \
         (scripts/gpu-check.sh does this)",
        nccl_library_candidates().join(", ")
    )
}

/// Whether one of [`nccl_library_candidates`] can be loaded (no GPU needed).
pub fn nccl_loadable() -> bool {
    // SAFETY: only tries to dlopen each candidate name.
    unsafe { sys::is_culib_present() }
}

/// `Ok` when a GPU and NCCL can be used (checked without touching cudarc's NCCL
/// loader, which panics when the library is missing); otherwise why not.
pub fn nccl_available() -> Result<meshplan_kernels::cuda::DeviceInfo, NcclError> {
    let info = meshplan_kernels::cuda::probe().map_err(|e| err(e.to_string()))?;
    if !nccl_loadable() {
        return Err(err(nccl_missing_message()));
    }
    Ok(info)
}

/// The NCCL version (`22703` for 2.27.3), after [`nccl_available`].
pub fn nccl_version() -> Result<i32, NcclError> {
    nccl_available()?;
    result::get_nccl_version().map_err(|e| err(format!("ncclGetVersion: {e:?}")))
}

/// An NCCL communicator handle, destroyed on drop (unless aborted).
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one at a time; the
// owning `NcclComm` is `Send` but not shared.
unsafe impl Send for RawComm {}

/// The [`Communicator`] over NCCL, one per rank (GPU).
pub struct NcclComm {
    // Communicators first: they are dropped before the stream and context.
    world_comm: RawComm,
    subs: HashMap<Vec<usize>, RawComm>,
    rank: usize,
    world: usize,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    counts: ByteCounts,
    aborted: Mutex<Option<String>>,
}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.ctx.ordinal())
            .field("sub_communicators", &self.subs.len())
            .finish()
    }
}

fn nccl_call(what: &str, r: Result<result::NcclStatus, result::NcclError>) -> Result<(), String> {
    r.map(|_| ()).map_err(|e| format!("{what}: {e:?}"))
}

impl NcclComm {
    fn on_device(ordinal: usize) -> Result<(Arc<CudaContext>, Arc<CudaStream>), NcclError> {
        let ctx =
            CudaContext::new(ordinal).map_err(|e| err(format!("CUDA device {ordinal}: {e:?}")))?;
        ctx.bind_to_thread()
            .map_err(|e| err(format!("binding device {ordinal}: {e:?}")))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| err(format!("communication stream on device {ordinal}: {e:?}")))?;
        Ok((ctx, stream))
    }

    fn new(
        comm: sys::ncclComm_t,
        rank: usize,
        world: usize,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
    ) -> NcclComm {
        NcclComm {
            world_comm: RawComm(comm),
            subs: HashMap::new(),
            rank,
            world,
            stream,
            ctx,
            counts: ByteCounts::new(),
            aborted: Mutex::new(None),
        }
    }

    /// One process per GPU: this process is `env.rank` of `env.world_size` and uses
    /// device `env.local_rank`. Rank 0 creates the NCCL unique id and broadcasts it
    /// through `rdv`; every rank then joins (`ncclCommInitRank`).
    pub fn from_launch(env: &LaunchEnv, rdv: &mut Rendezvous) -> Result<NcclComm, NcclError> {
        nccl_available()?;
        let (ctx, stream) = Self::on_device(env.local_rank)?;
        let mine = if env.rank == 0 {
            let id = result::get_uniqueid().map_err(|e| err(format!("ncclGetUniqueId: {e:?}")))?;
            id.internal.iter().map(|&c| c as u8).collect::<Vec<u8>>()
        } else {
            Vec::new()
        };
        let blob = rdv
            .broadcast(&mine)
            .map_err(|e| err(format!("broadcasting the NCCL id: {e}")))?;
        let id = id_from_bytes(&blob).ok_or_else(|| {
            err(format!(
                "rank 0's NCCL id has {} bytes, expected 128",
                blob.len()
            ))
        })?;
        let comm = init_rank(env.world_size, id, env.rank)
            .map_err(|e| err(format!("rank {}: {e}", env.rank)))?;
        Ok(Self::new(comm, env.rank, env.world_size, ctx, stream))
    }

    /// One process driving several GPUs: one communicator per device of `devices`
    /// (rank = index), created together (`ncclCommInitAll`). Move each to its own
    /// thread.
    pub fn in_process(devices: &[usize]) -> Result<Vec<NcclComm>, NcclError> {
        let info = nccl_available()?;
        if let Some(&d) = devices.iter().find(|&&d| d >= info.device_count) {
            return Err(err(format!(
                "device {d} requested, {} visible",
                info.device_count
            )));
        }
        let mut handles = Vec::with_capacity(devices.len());
        for &d in devices {
            handles.push(Self::on_device(d)?);
        }
        let ordinals: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` holds one slot per ordinal.
        nccl_call("ncclCommInitAll", unsafe {
            result::comm_init_all(comms.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr())
        })
        .map_err(err)?;
        let world = devices.len();
        Ok(comms
            .into_iter()
            .zip(handles)
            .enumerate()
            .map(|(rank, (c, (ctx, stream)))| Self::new(c, rank, world, ctx, stream))
            .collect())
    }

    /// The device this rank uses.
    pub fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    fn check_aborted(&self, kind: CommKind, axis: &str, group: &str) -> Result<(), CommError> {
        let a = self.aborted.lock().map_err(|_| CommError::Internal {
            detail: "abort flag poisoned".into(),
        })?;
        match &*a {
            None => Ok(()),
            Some(reason) => Err(CommError::Aborted {
                first_rank: self.rank,
                reason: reason.clone(),
                waiting_in: super::WaitPoint {
                    kind,
                    axis: axis.to_string(),
                    group: group.to_string(),
                    ranks: Vec::new(),
                    seq: 0,
                },
            }),
        }
    }

    /// This rank's index in `group` and the group's communicator (created on first
    /// use).
    fn group_comm(
        &mut self,
        group: &Group,
        kind: CommKind,
        axis: &str,
    ) -> Result<(usize, sys::ncclComm_t), CommError> {
        self.check_aborted(kind, axis, &group.id)?;
        let me = args::index_in(group, self.rank, kind)?;
        args::check_members(group, self.world, kind)?;
        if group.ranks.iter().copied().eq(0..self.world) {
            return Ok((me, self.world_comm.0));
        }
        if let Some(c) = self.subs.get(&group.ranks) {
            return Ok((me, c.0));
        }
        let c = self
            .create_sub(group, me)
            .map_err(|detail| CommError::Internal {
                detail: format!(
                    "creating the NCCL communicator of group {}: {detail}",
                    group.id
                ),
            })?;
        self.subs.insert(group.ranks.clone(), RawComm(c));
        Ok((me, c))
    }

    fn create_sub(&mut self, group: &Group, me: usize) -> Result<sys::ncclComm_t, String> {
        self.bind()?;
        let leader = group.ranks[0];
        let mut dev: CudaSlice<u8> = self.stream.alloc_zeros(128).map_err(|e| format!("{e:?}"))?;
        if me == 0 {
            let id = result::get_uniqueid().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            self.stream
                .memcpy_htod(&bytes, &mut dev)
                .map_err(|e| format!("{e:?}"))?;
            let (p, _g) = dev.device_ptr(&self.stream);
            nccl_call("ncclGroupStart", result::group_start())?;
            for &peer in &group.ranks[1..] {
                // SAFETY: `dev` holds 128 bytes and outlives the synchronisation below.
                nccl_call("ncclSend", unsafe {
                    result::send(
                        p as *const c_void,
                        128,
                        sys::ncclDataType_t::ncclUint8,
                        peer as i32,
                        self.world_comm.0,
                        self.raw_stream(),
                    )
                })?;
            }
            nccl_call("ncclGroupEnd", result::group_end())?;
            self.sync()?;
            return init_rank(group.size(), id, me);
        }
        {
            let (p, _g) = dev.device_ptr_mut(&self.stream);
            // SAFETY: as above.
            nccl_call("ncclRecv", unsafe {
                result::recv(
                    p as *mut c_void,
                    128,
                    sys::ncclDataType_t::ncclUint8,
                    leader as i32,
                    self.world_comm.0,
                    self.raw_stream(),
                )
            })?;
        }
        let bytes = self.stream.clone_dtoh(&dev).map_err(|e| format!("{e:?}"))?;
        self.sync()?;
        let id = id_from_bytes(&bytes).ok_or("short NCCL id")?;
        init_rank(group.size(), id, me)
    }

    fn bind(&self) -> Result<(), String> {
        self.ctx.bind_to_thread().map_err(|e| format!("{e:?}"))
    }

    fn raw_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    fn sync(&self) -> Result<(), String> {
        self.stream.synchronize().map_err(|e| format!("{e:?}"))
    }

    /// A device buffer of `n` floats (at least one, so a pointer exists), holding
    /// `host` at its start when given.
    fn stage(&self, n: usize, host: Option<&[f32]>) -> Result<CudaSlice<f32>, String> {
        let mut d: CudaSlice<f32> = self
            .stream
            .alloc_zeros(n.max(1))
            .map_err(|e| format!("device allocation of {n} floats: {e:?}"))?;
        if let Some(h) = host.filter(|h| !h.is_empty()) {
            let mut view = d.slice_mut(0..h.len());
            self.stream
                .memcpy_htod(h, &mut view)
                .map_err(|e| format!("upload: {e:?}"))?;
        }
        Ok(d)
    }

    fn fetch(&self, dev: &CudaSlice<f32>, out: &mut [f32]) -> Result<(), String> {
        if !out.is_empty() {
            let view = dev.slice(0..out.len());
            self.stream
                .memcpy_dtoh(&view, out)
                .map_err(|e| format!("download: {e:?}"))?;
        }
        self.sync()
    }

    /// Runs `f` (which enqueues NCCL work) with the device bound, mapping failures.
    fn run<T>(
        &self,
        kind: CommKind,
        f: impl FnOnce(&Self) -> Result<T, String>,
    ) -> Result<T, CommError> {
        self.bind()
            .and_then(|()| f(self))
            .map_err(|detail| CommError::Internal {
                detail: format!("NCCL {kind} on rank {}: {detail}", self.rank),
            })
    }
}

impl NcclComm {
    /// A collective on device buffers of `T`, on the communication stream once
    /// `ready` (recorded on the stream that wrote the buffers) has passed: an
    /// in-place all-reduce of `dst` (`src` `None`), a reduce-scatter of `src` into
    /// `dst`, or an all-gather of `src` into `dst`. Summed in `T` as NCCL sums it;
    /// bytes counted at [`Elem::BYTES`] an element, as the host collectives count
    /// theirs. The returned event marks its end: the consumer's stream waits on it,
    /// and the host waits for neither. The buffers stay alive, and unwritten, until
    /// it has passed.
    pub fn device_start<T: Elem>(
        &mut self,
        kind: CommKind,
        (group, axis): (&Group, &str),
        src: Option<&CudaSlice<T>>,
        dst: &mut CudaSlice<T>,
        ready: &CudaEvent,
    ) -> Result<CudaEvent, CommError> {
        let sizes = (src.map_or(dst.len(), |s| s.len()), dst.len());
        let dtype = (T::DTYPE, T::BYTES);
        self.device_collective(kind, group, axis, ready, dtype, sizes, |s| {
            let (pd, _g) = dst.device_ptr_mut(s);
            let ps = match src {
                Some(x) => x.device_ptr(s).0,
                None => pd,
            };
            (ps as *const c_void, pd as *mut c_void)
        })
    }

    /// All-to-All with uneven splits of bf16 device buffers (expert parallelism's
    /// token rows): `send_counts[j]` elements to member `j` from `send`, in group
    /// order, `recv_counts[i]` from member `i` into `recv`; one NCCL group of
    /// sends and receives on the communication stream after `ready`. Counted as
    /// the host's `all_to_all_v` counts (what leaves for the other members), at
    /// two bytes per element.
    pub fn all_to_all_v_bf16_device_start(
        &mut self,
        group: &Group,
        axis: &str,
        (send, send_counts): (&CudaSlice<bf16>, &[usize]),
        (recv, recv_counts): (&mut CudaSlice<bf16>, &[usize]),
        ready: &CudaEvent,
    ) -> Result<CudaEvent, CommError> {
        let kind = CommKind::AllToAllV;
        let n = group.size();
        args::all_to_all_v(n, (send.len(), send_counts), (recv.len(), recv_counts))?;
        let (me, comm) = self.group_comm(group, kind, axis)?;
        let done = self.run(kind, |s| {
            s.stream
                .wait(ready)
                .map_err(|e| format!("waiting for the buffers' writer: {e:?}"))?;
            let raw = s.raw_stream();
            let (ps, _gs) = send.device_ptr(&s.stream);
            let (pr, _gr) = recv.device_ptr_mut(&s.stream);
            nccl_call("ncclGroupStart", result::group_start())?;
            let (mut so, mut ro) = (0usize, 0usize);
            let mut status = Ok(());
            for (j, (&sc, &rc)) in send_counts.iter().zip(recv_counts).enumerate() {
                if sc > 0 && status.is_ok() {
                    let p = (ps + (so * 2) as u64) as *const c_void;
                    // SAFETY: `so + sc <= send.len()` (the counts were checked
                    // against the buffers); alive until the returned event.
                    status = nccl_call("ncclSend", unsafe {
                        result::send(p, sc, BF16, j as i32, comm, raw)
                    });
                }
                if rc > 0 && status.is_ok() {
                    let p = (pr + (ro * 2) as u64) as *mut c_void;
                    // SAFETY: as for the send; `recv` is borrowed mutably.
                    status = nccl_call("ncclRecv", unsafe {
                        result::recv(p, rc, BF16, j as i32, comm, raw)
                    });
                }
                so += sc;
                ro += rc;
            }
            // Always close the group, even after a failed enqueue.
            let end = nccl_call("ncclGroupEnd", result::group_end());
            status?;
            end?;
            s.stream
                .record_event(None)
                .map_err(|e| format!("recording the exchange's end: {e:?}"))
        })?;
        let to_others: usize = send_counts
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != me)
            .map(|(_, &c)| c)
            .sum();
        let (b, o) = (send.len() as u64 * 2, to_others as u64 * 2);
        self.counts.record(kind, axis, b, u128::from(o), 1);
        Ok(done)
    }

    /// Point-to-point transfers of bf16 device buffers (pipeline boundaries, ring
    /// attention's blocks) as one NCCL group on the communication stream, after
    /// `ready`: a ring's send to the next rank and receive from the previous one
    /// complete together instead of waiting on each other. The returned event
    /// marks the group's end; the buffers stay alive and unwritten until it has
    /// passed. Bytes counted at two per element, as the host p2p counts its own.
    pub fn p2p_bf16_device_start(
        &mut self,
        axis: &str,
        transfers: &mut [P2p<'_>],
        ready: &CudaEvent,
    ) -> Result<CudaEvent, CommError> {
        for t in transfers.iter() {
            let (kind, peer) = match t {
                P2p::Send(peer, buf, (off, n)) => {
                    if off + n > buf.len() {
                        return Err(CommError::Internal {
                            detail: format!("sending {off}..{} of {}", off + n, buf.len()),
                        });
                    }
                    (CommKind::Send, *peer)
                }
                P2p::Recv(peer, _) => (CommKind::Recv, *peer),
            };
            self.check_peer(kind, peer)?;
            self.check_aborted(kind, axis, "p2p")?;
        }
        let comm = self.world_comm.0;
        let done = self.run(CommKind::Send, |s| {
            s.stream
                .wait(ready)
                .map_err(|e| format!("waiting for the buffers' writer: {e:?}"))?;
            let raw = s.raw_stream();
            // Held until the group is enqueued, which is when NCCL reads the
            // pointers onto the stream.
            let mut guards: Vec<SyncOnDrop<'_>> = Vec::new();
            nccl_call("ncclGroupStart", result::group_start())?;
            for t in transfers.iter_mut() {
                let r = match t {
                    P2p::Send(peer, buf, (off, n)) => {
                        let (p, g) = buf.device_ptr(&s.stream);
                        guards.push(g);
                        let p = (p + (*off * 2) as u64) as *const c_void;
                        // SAFETY: `p` points at `n` bf16 elements inside `buf`
                        // (checked above), alive until the returned event.
                        unsafe { result::send(p, *n, BF16, *peer as i32, comm, raw) }
                    }
                    P2p::Recv(peer, buf) => {
                        let n = buf.len();
                        let (p, g) = buf.device_ptr_mut(&s.stream);
                        guards.push(g);
                        // SAFETY: as for a send; `buf` is borrowed mutably.
                        unsafe { result::recv(p as *mut c_void, n, BF16, *peer as i32, comm, raw) }
                    }
                };
                nccl_call("nccl p2p", r)?;
            }
            nccl_call("ncclGroupEnd", result::group_end())?;
            drop(guards);
            s.stream
                .record_event(None)
                .map_err(|e| format!("recording the transfers' end: {e:?}"))
        })?;
        for t in transfers.iter() {
            match t {
                P2p::Send(_, _, (_, n)) => {
                    let b = *n as u64 * 2;
                    self.counts
                        .record(CommKind::Send, axis, b, u128::from(b), 1);
                }
                P2p::Recv(_, buf) => {
                    self.counts
                        .record(CommKind::Recv, axis, buf.len() as u64 * 2, 0, 1);
                }
            }
        }
        Ok(done)
    }

    /// One all-reduce, reduce-scatter or all-gather of `dtype` (`size` bytes an
    /// element) from `n_in` to `n_out` elements at the pointers `ptrs` gives for the
    /// communication stream, after `ready`.
    #[allow(clippy::too_many_arguments)] // the collective's shape, its buffers, and when
    fn device_collective(
        &mut self,
        kind: CommKind,
        group: &Group,
        axis: &str,
        ready: &CudaEvent,
        (dtype, size): (sys::ncclDataType_t, u64),
        (n_in, n_out): (usize, usize),
        ptrs: impl FnOnce(&CudaStream) -> (*const c_void, *mut c_void),
    ) -> Result<CudaEvent, CommError> {
        let members = group.size();
        match kind {
            CommKind::AllReduce if n_in == n_out => {}
            CommKind::ReduceScatter => args::reduce_scatter(members, n_in, n_out)?,
            CommKind::AllGather => args::all_gather(members, n_in, n_out)?,
            _ => {
                return Err(CommError::Internal {
                    detail: format!("{kind} of {n_in} into {n_out} elements on device buffers"),
                })
            }
        }
        let (_, comm) = self.group_comm(group, kind, axis)?;
        let done = self.run(kind, |s| {
            s.stream
                .wait(ready)
                .map_err(|e| format!("waiting for the buffer's writer: {e:?}"))?;
            if n_out > 0 {
                let (ps, pd) = ptrs(&s.stream);
                let raw = s.raw_stream();
                // SAFETY: `ps` holds `n_in` and `pd` `n_out` elements of `dtype`, as
                // the collective's shape was checked above; the caller keeps both
                // alive and unwritten until the returned event has passed.
                let r = unsafe {
                    match kind {
                        CommKind::ReduceScatter => {
                            result::reduce_scatter(ps, pd, n_out, dtype, SUM, comm, raw)
                        }
                        CommKind::AllGather => result::all_gather(ps, pd, n_in, dtype, comm, raw),
                        _ => result::all_reduce(ps, pd, n_out, dtype, SUM, comm, raw),
                    }
                };
                nccl_call(&format!("nccl {kind}"), r)?;
            }
            s.stream
                .record_event(None)
                .map_err(|e| format!("recording the collective's end: {e:?}"))
        })?;
        // Counted as the host collectives count them: the larger side's bytes.
        let payload = n_in.max(n_out) as u64 * size;
        let (num, den) = ring_bytes(kind, members, payload);
        self.counts.record(kind, axis, payload, num, den);
        Ok(done)
    }
}

/// One point-to-point transfer of a bf16 device buffer, to or from a global rank.
pub enum P2p<'b> {
    /// `buf[off..off + n]` to the rank.
    Send(usize, &'b CudaSlice<bf16>, (usize, usize)),
    /// The whole of `buf` from the rank.
    Recv(usize, &'b mut CudaSlice<bf16>),
}

fn id_from_bytes(b: &[u8]) -> Option<sys::ncclUniqueId> {
    let arr: [u8; 128] = b.try_into().ok()?;
    Some(sys::ncclUniqueId {
        internal: arr.map(|c| c as std::ffi::c_char),
    })
}

fn init_rank(n: usize, id: sys::ncclUniqueId, rank: usize) -> Result<sys::ncclComm_t, String> {
    let mut c = std::mem::MaybeUninit::uninit();
    // SAFETY: `c` is written by NCCL on success.
    nccl_call("ncclCommInitRank", unsafe {
        result::comm_init_rank(c.as_mut_ptr(), n as i32, id, rank as i32)
    })?;
    // SAFETY: initialised above.
    Ok(unsafe { c.assume_init() })
}

fn bytes_of(elements: usize) -> u64 {
    (elements as u64) * 4
}

fn ptr(d: &CudaSlice<f32>, s: &CudaStream, offset: usize) -> *const c_void {
    let (p, _g) = d.device_ptr(s);
    (p + (offset * 4) as u64) as *const c_void
}

fn ptr_mut(d: &mut CudaSlice<f32>, s: &CudaStream, offset: usize) -> *mut c_void {
    let (p, _g) = d.device_ptr_mut(s);
    (p + (offset * 4) as u64) as *mut c_void
}

const F32: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
const BF16: sys::ncclDataType_t = sys::ncclDataType_t::ncclBfloat16;
const SUM: sys::ncclRedOp_t = sys::ncclRedOp_t::ncclSum;

/// An element type of NCCL's collectives on device buffers.
pub trait Elem: DeviceRepr {
    /// NCCL's name for it.
    const DTYPE: sys::ncclDataType_t;
    /// Bytes an element.
    const BYTES: u64;
}

impl Elem for f32 {
    const DTYPE: sys::ncclDataType_t = F32;
    const BYTES: u64 = 4;
}

impl Elem for bf16 {
    const DTYPE: sys::ncclDataType_t = BF16;
    const BYTES: u64 = 2;
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&mut self, group: &Group, axis: &str, buf: &mut [f32]) -> Result<(), CommError> {
        let kind = CommKind::AllReduce;
        let (_, comm) = self.group_comm(group, kind, axis)?;
        self.run(kind, |s| {
            let mut d = s.stage(buf.len(), Some(buf))?;
            let p = ptr_mut(&mut d, &s.stream, 0);
            // SAFETY: `d` holds `buf.len()` floats (at least one) and lives past the sync.
            nccl_call("ncclAllReduce", unsafe {
                result::all_reduce(p, p, buf.len(), F32, SUM, comm, s.raw_stream())
            })?;
            s.fetch(&d, buf)
        })?;
        let payload = bytes_of(buf.len());
        let (num, den) = ring_bytes(kind, group.size(), payload);
        self.counts.record(kind, axis, payload, num, den);
        Ok(())
    }

    fn all_gather(
        &mut self,
        group: &Group,
        axis: &str,
        local: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        let kind = CommKind::AllGather;
        let n = group.size();
        args::all_gather(n, local.len(), out.len())?;
        let (_, comm) = self.group_comm(group, kind, axis)?;
        self.run(kind, |s| {
            let src = s.stage(local.len(), Some(local))?;
            let mut dst = s.stage(out.len(), None)?;
            let (ps, pd) = (ptr(&src, &s.stream, 0), ptr_mut(&mut dst, &s.stream, 0));
            // SAFETY: sizes as checked above.
            nccl_call("ncclAllGather", unsafe {
                result::all_gather(ps, pd, local.len(), F32, comm, s.raw_stream())
            })?;
            s.fetch(&dst, out)
        })?;
        let payload = bytes_of(out.len());
        let (num, den) = ring_bytes(kind, n, payload);
        self.counts.record(kind, axis, payload, num, den);
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        group: &Group,
        axis: &str,
        input: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        let kind = CommKind::ReduceScatter;
        let n = group.size();
        args::reduce_scatter(n, input.len(), out.len())?;
        let (_, comm) = self.group_comm(group, kind, axis)?;
        self.run(kind, |s| {
            let src = s.stage(input.len(), Some(input))?;
            let mut dst = s.stage(out.len(), None)?;
            let (ps, pd) = (ptr(&src, &s.stream, 0), ptr_mut(&mut dst, &s.stream, 0));
            // SAFETY: sizes as checked above.
            nccl_call("ncclReduceScatter", unsafe {
                result::reduce_scatter(ps, pd, out.len(), F32, SUM, comm, s.raw_stream())
            })?;
            s.fetch(&dst, out)
        })?;
        let payload = bytes_of(input.len());
        let (num, den) = ring_bytes(kind, n, payload);
        self.counts.record(kind, axis, payload, num, den);
        Ok(())
    }

    fn broadcast(
        &mut self,
        group: &Group,
        axis: &str,
        buf: &mut [f32],
        root_index: usize,
    ) -> Result<(), CommError> {
        let kind = CommKind::Broadcast;
        let n = group.size();
        args::broadcast(n, root_index)?;
        let (_, comm) = self.group_comm(group, kind, axis)?;
        self.run(kind, |s| {
            let mut d = s.stage(buf.len(), Some(buf))?;
            let p = ptr_mut(&mut d, &s.stream, 0);
            // SAFETY: in place, `buf.len()` floats.
            nccl_call("ncclBroadcast", unsafe {
                result::broadcast(
                    p,
                    p,
                    buf.len(),
                    F32,
                    root_index as i32,
                    comm,
                    s.raw_stream(),
                )
            })?;
            s.fetch(&d, buf)
        })?;
        let payload = bytes_of(buf.len());
        let (num, den) = ring_bytes(kind, n, payload);
        self.counts.record(kind, axis, payload, num, den);
        Ok(())
    }

    fn all_to_all(
        &mut self,
        group: &Group,
        axis: &str,
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), CommError> {
        let kind = CommKind::AllToAll;
        let n = group.size();
        args::all_to_all(n, send.len(), recv.len())?;
        let (_, comm) = self.group_comm(group, kind, axis)?;
        let p = send.len() / n;
        let counts = vec![p; n];
        self.run(kind, |s| {
            grouped_exchange(s, comm, (send, &counts), (recv, &counts))
        })?;
        let payload = bytes_of(send.len());
        let (num, den) = ring_bytes(kind, n, payload);
        self.counts.record(kind, axis, payload, num, den);
        Ok(())
    }

    fn all_to_all_v(
        &mut self,
        group: &Group,
        axis: &str,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let kind = CommKind::AllToAllV;
        let n = group.size();
        args::all_to_all_v(n, (send.len(), send_counts), (recv.len(), recv_counts))?;
        let (me, comm) = self.group_comm(group, kind, axis)?;
        self.run(kind, |s| {
            grouped_exchange(s, comm, (send, send_counts), (recv, recv_counts))
        })?;
        let to_others: usize = send_counts
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != me)
            .map(|(_, &c)| c)
            .sum();
        self.counts.record(
            kind,
            axis,
            bytes_of(send.len()),
            u128::from(bytes_of(to_others)),
            1,
        );
        Ok(())
    }

    fn send(&mut self, peer: usize, axis: &str, buf: &[f32]) -> Result<(), CommError> {
        let kind = CommKind::Send;
        self.check_peer(kind, peer)?;
        self.check_aborted(kind, axis, "p2p")?;
        let comm = self.world_comm.0;
        if !buf.is_empty() {
            self.run(kind, |s| {
                let d = s.stage(buf.len(), Some(buf))?;
                // SAFETY: `d` holds `buf.len()` floats and lives past the sync.
                nccl_call("ncclSend", unsafe {
                    result::send(
                        ptr(&d, &s.stream, 0),
                        buf.len(),
                        F32,
                        peer as i32,
                        comm,
                        s.raw_stream(),
                    )
                })?;
                s.sync()
            })?;
        }
        let b = bytes_of(buf.len());
        self.counts.record(kind, axis, b, u128::from(b), 1);
        Ok(())
    }

    fn recv(&mut self, peer: usize, axis: &str, buf: &mut [f32]) -> Result<(), CommError> {
        let kind = CommKind::Recv;
        self.check_peer(kind, peer)?;
        self.check_aborted(kind, axis, "p2p")?;
        let comm = self.world_comm.0;
        if !buf.is_empty() {
            self.run(kind, |s| {
                let mut d = s.stage(buf.len(), None)?;
                // SAFETY: as for send.
                nccl_call("ncclRecv", unsafe {
                    result::recv(
                        ptr_mut(&mut d, &s.stream, 0),
                        buf.len(),
                        F32,
                        peer as i32,
                        comm,
                        s.raw_stream(),
                    )
                })?;
                s.fetch(&d, buf)
            })?;
        }
        self.counts.record(kind, axis, bytes_of(buf.len()), 0, 1);
        Ok(())
    }

    fn barrier(&mut self, group: &Group) -> Result<(), CommError> {
        let kind = CommKind::Barrier;
        let (_, comm) = self.group_comm(group, kind, &group.id)?;
        self.run(kind, |s| {
            let mut d = s.stage(1, None)?;
            let p = ptr_mut(&mut d, &s.stream, 0);
            // SAFETY: one float.
            nccl_call("ncclAllReduce (barrier)", unsafe {
                result::all_reduce(p, p, 1, F32, SUM, comm, s.raw_stream())
            })?;
            s.sync()
        })
    }

    fn counts(&self) -> ByteCounts {
        self.counts.clone()
    }

    fn abort(&self, reason: String) {
        if let Ok(mut a) = self.aborted.lock() {
            if a.is_some() {
                return;
            }
            *a = Some(reason);
        }
        // Peers blocked in a collective with this rank get an error instead of a hang.
        let _ = self.bind();
        for c in std::iter::once(&self.world_comm).chain(self.subs.values()) {
            // SAFETY: the handle is live; Drop skips destroying aborted communicators.
            let _ = unsafe { result::comm_abort(c.0) };
        }
    }
}

impl NcclComm {
    fn check_peer(&self, kind: CommKind, peer: usize) -> Result<(), CommError> {
        if peer >= self.world || peer == self.rank {
            return Err(CommError::InvalidArgument {
                kind,
                detail: format!(
                    "peer {peer} for rank {} in a world of {}",
                    self.rank, self.world
                ),
            });
        }
        Ok(())
    }
}

/// Grouped send/recv: `send_counts[j]` floats (consecutive) to member `j`,
/// `recv_counts[j]` from it; the own block is exchanged with itself, as NCCL allows.
fn grouped_exchange(
    s: &NcclComm,
    comm: sys::ncclComm_t,
    send: (&[f32], &[usize]),
    recv: (&mut [f32], &[usize]),
) -> Result<(), String> {
    let (send, send_counts) = send;
    let (recv, recv_counts) = recv;
    let src = s.stage(send.len(), Some(send))?;
    let mut dst = s.stage(recv.len(), None)?;
    nccl_call("ncclGroupStart", result::group_start())?;
    let (mut so, mut ro) = (0, 0);
    let mut status = Ok(());
    for (j, (&sc, &rc)) in send_counts.iter().zip(recv_counts).enumerate() {
        if sc > 0 && status.is_ok() {
            // SAFETY: offsets stay within the staged buffers (counts checked by the caller).
            status = nccl_call("ncclSend", unsafe {
                result::send(
                    ptr(&src, &s.stream, so),
                    sc,
                    F32,
                    j as i32,
                    comm,
                    s.raw_stream(),
                )
            });
        }
        if rc > 0 && status.is_ok() {
            // SAFETY: as above.
            status = nccl_call("ncclRecv", unsafe {
                result::recv(
                    ptr_mut(&mut dst, &s.stream, ro),
                    rc,
                    F32,
                    j as i32,
                    comm,
                    s.raw_stream(),
                )
            });
        }
        so += sc;
        ro += rc;
    }
    // Always close the group, even after a failed enqueue.
    let end = nccl_call("ncclGroupEnd", result::group_end());
    status?;
    end?;
    s.fetch(&dst, recv)
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let aborted = self.aborted.lock().map(|a| a.is_some()).unwrap_or(true);
        if aborted {
            return;
        }
        let _ = self.bind();
        let _ = self.stream.synchronize();
        for c in self.subs.values().chain(std::iter::once(&self.world_comm)) {
            // SAFETY: each handle is live and destroyed once.
            let _ = unsafe { result::comm_destroy(c.0) };
        }
    }
}

/// A collective for [`NcclBench`] (nccl-tests style timing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchOp {
    /// `ncclAllReduce` (sum) of the whole buffer.
    AllReduce,
    /// `ncclAllGather` into the whole buffer.
    AllGather,
    /// `ncclReduceScatter` of the whole buffer.
    ReduceScatter,
    /// `ncclBroadcast` of the whole buffer from rank 0.
    Broadcast,
    /// Grouped send/recv of `1/n` of the buffer to every member.
    AllToAll,
    /// Rank 0 sends the whole buffer to rank 1 (two ranks).
    SendRecv,
}

/// Times NCCL collectives on device buffers, all GPUs of the process driven from one
/// thread in NCCL groups (the way nccl-tests' `-g` mode does).
pub struct NcclBench {
    comms: Vec<NcclComm>,
}

impl NcclBench {
    /// Communicators over `devices` (rank = index).
    pub fn new(devices: &[usize]) -> Result<NcclBench, NcclError> {
        Ok(NcclBench {
            comms: NcclComm::in_process(devices)?,
        })
    }

    /// Median seconds of `op` on a buffer of `bytes` bytes (fp32 elements, rounded
    /// down to a multiple of the rank count) after `warmup` untimed runs.
    pub fn time(
        &self,
        op: BenchOp,
        bytes: u64,
        warmup: u32,
        repeats: u32,
    ) -> Result<f64, NcclError> {
        let n = self.comms.len();
        if op == BenchOp::SendRecv && n != 2 {
            return Err(err(format!("send/recv is timed between 2 GPUs, not {n}")));
        }
        let elems = ((bytes / 4) as usize / n).max(1) * n;
        let mut bufs = Vec::with_capacity(n);
        for c in &self.comms {
            c.bind().map_err(err)?;
            let a: CudaSlice<f32> = c
                .stream
                .alloc_zeros(elems)
                .map_err(|e| err(format!("{e:?}")))?;
            let b: CudaSlice<f32> = c
                .stream
                .alloc_zeros(elems)
                .map_err(|e| err(format!("{e:?}")))?;
            bufs.push((a, b));
        }
        let part = elems / n;
        let mut once = || -> Result<(), String> {
            nccl_call("ncclGroupStart", result::group_start())?;
            let mut status = Ok(());
            for (r, (c, (a, b))) in self.comms.iter().zip(bufs.iter_mut()).enumerate() {
                if status.is_err() {
                    break;
                }
                let (st, comm) = (c.raw_stream(), c.world_comm.0);
                let (pa, pb) = (ptr(a, &c.stream, 0), ptr_mut(b, &c.stream, 0));
                // SAFETY: both buffers hold `elems` floats and outlive the synchronisation.
                status = unsafe {
                    match op {
                        BenchOp::AllReduce => nccl_call(
                            "ncclAllReduce",
                            result::all_reduce(pa, pb, elems, F32, SUM, comm, st),
                        ),
                        BenchOp::AllGather => nccl_call(
                            "ncclAllGather",
                            result::all_gather(pa, pb, part, F32, comm, st),
                        ),
                        BenchOp::ReduceScatter => nccl_call(
                            "ncclReduceScatter",
                            result::reduce_scatter(pa, pb, part, F32, SUM, comm, st),
                        ),
                        BenchOp::Broadcast => nccl_call(
                            "ncclBroadcast",
                            result::broadcast(pa, pb, elems, F32, 0, comm, st),
                        ),
                        BenchOp::AllToAll => (0..n).try_for_each(|j| {
                            let off = (j * part * 4) as u64;
                            nccl_call(
                                "ncclSend",
                                result::send(
                                    (pa as u64 + off) as *const c_void,
                                    part,
                                    F32,
                                    j as i32,
                                    comm,
                                    st,
                                ),
                            )?;
                            nccl_call(
                                "ncclRecv",
                                result::recv(
                                    (pb as u64 + off) as *mut c_void,
                                    part,
                                    F32,
                                    j as i32,
                                    comm,
                                    st,
                                ),
                            )
                        }),
                        BenchOp::SendRecv if r == 0 => {
                            nccl_call("ncclSend", result::send(pa, elems, F32, 1, comm, st))
                        }
                        BenchOp::SendRecv => {
                            nccl_call("ncclRecv", result::recv(pb, elems, F32, 0, comm, st))
                        }
                    }
                };
            }
            let end = nccl_call("ncclGroupEnd", result::group_end());
            status?;
            end?;
            for c in &self.comms {
                c.sync()?;
            }
            Ok(())
        };
        for _ in 0..warmup {
            once().map_err(err)?;
        }
        let mut times = Vec::with_capacity(repeats.max(1) as usize);
        for _ in 0..repeats.max(1) {
            let t = std::time::Instant::now();
            once().map_err(err)?;
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }
}

#[cfg(test)]
mod tests;
