//! [`NcclComm`]: the [`Communicator`] trait over NCCL (feature `cuda`).
//!
//! Two faces over one set of NCCL communicators. As a [`Communicator`] (`host.rs`)
//! its buffers are host slices, as for [`super::ThreadComm`]: each call uploads
//! them to device memory, runs NCCL on a dedicated communication stream, downloads
//! the result and synchronises that stream (two PCIe copies a call: for the few
//! host floats of a step, the losses and the routing counts). On device buffers
//! (`device.rs`) the interpreter's collectives and transfers stay in GPU memory,
//! joined to the compute stream by events.
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
use std::sync::{Arc, Mutex, PoisonError};

use meshplan_kernels::cuda::bf16;
use meshplan_kernels::cuda::cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop,
};
use meshplan_kernels::cuda::cudarc::nccl::{result, sys};

use super::args;
use super::counts::bytes_of;
use super::{AbortHandle, ByteCounts, CommError, CommKind, Communicator, Group};
use meshplan_launch::{LaunchEnv, Rendezvous};

/// Why an NCCL communicator could not be created.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{detail}")]
pub struct NcclError {
    /// What failed, with what to do where known.
    pub detail: String,
}

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

/// An NCCL communicator handle, destroyed on drop (unless aborted).
#[derive(Clone, Copy)]
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
    abort: Arc<Mutex<Aborting>>,
}

/// What an [`AbortHandle`] on another thread shares with its communicator, under
/// one lock: the world's first failure, and the handles aborting frees (none once
/// the communicator has destroyed them, so neither frees what the other did).
#[derive(Default)]
struct Aborting {
    failure: Option<(usize, String)>,
    comms: Vec<RawComm>,
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
            abort: Arc::new(Mutex::new(Aborting {
                failure: None,
                comms: vec![RawComm(comm)],
            })),
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

    fn check_aborted(&self, kind: CommKind, axis: &str, group: &str) -> Result<(), CommError> {
        self.aborted(kind, axis, group).map_or(Ok(()), Err)
    }

    /// [`CommError::Aborted`] once this communicator has been aborted.
    fn aborted(&self, kind: CommKind, axis: &str, group: &str) -> Option<CommError> {
        let a = self.abort.lock().unwrap_or_else(PoisonError::into_inner);
        let (first_rank, reason) = a.failure.clone()?;
        Some(CommError::Aborted {
            first_rank,
            reason,
            waiting_in: super::WaitPoint {
                kind,
                axis: axis.to_string(),
                group: group.to_string(),
                ranks: Vec::new(),
                seq: 0,
            },
        })
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
        let mut a = self.abort.lock().unwrap_or_else(PoisonError::into_inner);
        a.comms.push(RawComm(c));
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
            in_group(|| {
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
                Ok(())
            })?;
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
    /// An operation that another rank's failure aborted while this rank waited
    /// in it fails as [`CommError::Aborted`], naming that rank.
    fn run<T>(
        &self,
        kind: CommKind,
        axis: &str,
        f: impl FnOnce(&Self) -> Result<T, String>,
    ) -> Result<T, CommError> {
        self.bind().and_then(|()| f(self)).map_err(|detail| {
            self.aborted(kind, axis, axis)
                .unwrap_or_else(|| CommError::Internal {
                    detail: format!("NCCL {kind} on rank {}: {detail}", self.rank),
                })
        })
    }
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

/// Runs `f`'s NCCL calls as one group, which is closed even after a failed enqueue,
/// as NCCL requires; the first error wins.
fn in_group(f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    nccl_call("ncclGroupStart", result::group_start())?;
    let status = f();
    status.and(nccl_call("ncclGroupEnd", result::group_end()))
}

/// Inside a group: `send_counts[j]` consecutive elements from `ps` to member `j`,
/// `recv_counts[j]` from it into `pr`, elements of `dtype` and `size` bytes.
///
/// # Safety
/// The runs lie inside the buffers at `ps` and `pr`, which stay alive and
/// untouched until the stream has passed the group.
unsafe fn exchange_runs(
    (ps, send_counts): (u64, &[usize]),
    (pr, recv_counts): (u64, &[usize]),
    (dtype, size): (sys::ncclDataType_t, usize),
    (comm, raw): (sys::ncclComm_t, sys::cudaStream_t),
) -> Result<(), String> {
    let (mut so, mut ro) = (0, 0);
    for (j, (&sc, &rc)) in send_counts.iter().zip(recv_counts).enumerate() {
        if sc > 0 {
            let p = (ps + (so * size) as u64) as *const c_void;
            // SAFETY: inside the send buffer, by the caller's contract.
            nccl_call("ncclSend", unsafe {
                result::send(p, sc, dtype, j as i32, comm, raw)
            })?;
        }
        if rc > 0 {
            let p = (pr + (ro * size) as u64) as *mut c_void;
            // SAFETY: inside the receive buffer, by the caller's contract.
            nccl_call("ncclRecv", unsafe {
                result::recv(p, rc, dtype, j as i32, comm, raw)
            })?;
        }
        so += sc;
        ro += rc;
    }
    Ok(())
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

impl Drop for NcclComm {
    fn drop(&mut self) {
        let _ = self.bind();
        // Not under the lock: an abort on another thread must be able to end a
        // wait here for a peer that failed.
        let _ = self.stream.synchronize();
        // Held to the end: an abort that comes now waits, then finds nothing to free.
        let mut a = self.abort.lock().unwrap_or_else(PoisonError::into_inner);
        if a.failure.is_some() {
            return;
        }
        a.comms.clear();
        for c in self.subs.values().chain(std::iter::once(&self.world_comm)) {
            // SAFETY: each handle is live and destroyed once.
            let _ = unsafe { result::comm_destroy(c.0) };
        }
    }
}

mod bench;
mod device;
mod host;
#[cfg(test)]
mod tests;

pub use bench::NcclBench;
pub use device::{Elem, P2p};
