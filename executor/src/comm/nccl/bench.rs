//! Timing NCCL collectives on device buffers (`meshplan calibrate`).

use super::*;
use meshplan_ir::plan::LinkOp;

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
        op: LinkOp,
        bytes: u64,
        warmup: u32,
        repeats: u32,
    ) -> Result<f64, NcclError> {
        let n = self.comms.len();
        if op == LinkOp::SendRecv && n != 2 {
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
        let mut once = || -> Result<(), String> {
            in_group(|| {
                for (r, (c, (a, b))) in self.comms.iter().zip(bufs.iter_mut()).enumerate() {
                    let (st, comm) = (c.raw_stream(), c.world_comm.0);
                    let (pa, pb) = (ptr(a, &c.stream, 0), ptr_mut(b, &c.stream, 0));
                    // SAFETY: both buffers hold `elems` floats and outlive the
                    // synchronisation.
                    unsafe { launch(op, (pa, pb), (elems, n), r, (comm, st)) }?;
                }
                Ok(())
            })?;
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

/// Rank `r`'s part of one `op` (of `n` ranks) over `elems` floats from `pa` into
/// `pb`, enqueued on `st` inside the caller's NCCL group.
///
/// # Safety
/// `pa` and `pb` hold `elems` floats on the stream's device and outlive the
/// group's synchronisation.
unsafe fn launch(
    op: LinkOp,
    (pa, pb): (*const c_void, *mut c_void),
    (elems, n): (usize, usize),
    r: usize,
    (comm, st): (sys::ncclComm_t, sys::cudaStream_t),
) -> Result<(), String> {
    let part = elems / n;
    match op {
        LinkOp::AllReduce => nccl_call(
            "ncclAllReduce",
            result::all_reduce(pa, pb, elems, F32, SUM, comm, st),
        ),
        LinkOp::AllGather => nccl_call(
            "ncclAllGather",
            result::all_gather(pa, pb, part, F32, comm, st),
        ),
        LinkOp::ReduceScatter => nccl_call(
            "ncclReduceScatter",
            result::reduce_scatter(pa, pb, part, F32, SUM, comm, st),
        ),
        LinkOp::Broadcast => nccl_call(
            "ncclBroadcast",
            result::broadcast(pa, pb, elems, F32, 0, comm, st),
        ),
        LinkOp::AllToAll => {
            let runs = vec![part; n];
            let (ps, pr) = ((pa as u64, &runs[..]), (pb as u64, &runs[..]));
            // SAFETY: `n` runs of `part` floats fill both buffers (the caller's contract).
            unsafe { exchange_runs(ps, pr, (F32, 4), (comm, st)) }
        }
        LinkOp::SendRecv if r == 0 => {
            nccl_call("ncclSend", result::send(pa, elems, F32, 1, comm, st))
        }
        LinkOp::SendRecv => nccl_call("ncclRecv", result::recv(pb, elems, F32, 0, comm, st)),
    }
}
