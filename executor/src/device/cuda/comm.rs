//! The CUDA device's communicator: NCCL on GPU memory, on NCCL's stream joined to
//! the compute stream by events; or, for ranks sharing one GPU in one process, a
//! host communicator through which the buffers are staged (download, move,
//! upload).

use super::{CudaDevice, A, F};
use crate::comm::{
    AbortHandle, ByteCounts, CommError, CommKind, Communicator, Group, NcclComm, P2p,
};
use crate::device::comm::{part_of, CResult, DeviceComm, Kind, On, Recvd, Sent};
use crate::device::Buffers;
use meshplan_kernels::cuda::bf16;
use meshplan_kernels::cuda::cudarc::driver::{CudaEvent, CudaSlice};

/// A gradient bucket's sum: finished (through the host), or in flight on NCCL's
/// stream until `done`.
#[derive(Debug)]
pub enum Reduction {
    /// Summed already.
    Done(CudaSlice<f32>),
    /// Being summed by NCCL; `buf` is not to be touched before `done`.
    InFlight {
        /// The bucket.
        buf: CudaSlice<f32>,
        /// Recorded on NCCL's stream after the sum.
        done: CudaEvent,
    },
}

/// What a CUDA rank moves its buffers with.
pub enum CudaComm {
    /// NCCL, on the GPU's buffers: one GPU a rank.
    Nccl(NcclComm),
    /// A host communicator: ranks sharing a GPU, their buffers staged through the
    /// host.
    Staged(Box<dyn Communicator>),
}

impl CudaComm {
    fn host(&self) -> &dyn Communicator {
        match self {
            CudaComm::Nccl(n) => n,
            CudaComm::Staged(h) => h.as_ref(),
        }
    }

    fn host_mut(&mut self) -> &mut dyn Communicator {
        match self {
            CudaComm::Nccl(n) => n,
            CudaComm::Staged(h) => h.as_mut(),
        }
    }
}

/// The host collectives (losses, token counts, routing counts) of either kind.
impl Communicator for CudaComm {
    fn rank(&self) -> usize {
        self.host().rank()
    }
    fn world(&self) -> usize {
        self.host().world()
    }
    fn all_reduce(&mut self, group: &Group, axis: &str, buf: &mut [f32]) -> CResult<()> {
        self.host_mut().all_reduce(group, axis, buf)
    }
    fn all_gather(&mut self, g: &Group, axis: &str, local: &[f32], out: &mut [f32]) -> CResult<()> {
        self.host_mut().all_gather(g, axis, local, out)
    }
    fn reduce_scatter(&mut self, g: &Group, axis: &str, x: &[f32], out: &mut [f32]) -> CResult<()> {
        self.host_mut().reduce_scatter(g, axis, x, out)
    }
    fn broadcast(&mut self, g: &Group, axis: &str, buf: &mut [f32], root: usize) -> CResult<()> {
        self.host_mut().broadcast(g, axis, buf, root)
    }
    fn all_to_all(&mut self, g: &Group, axis: &str, send: &[f32], recv: &mut [f32]) -> CResult<()> {
        self.host_mut().all_to_all(g, axis, send, recv)
    }
    fn all_to_all_v(
        &mut self,
        g: &Group,
        axis: &str,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> CResult<()> {
        (self.host_mut()).all_to_all_v(g, axis, send, send_counts, recv, recv_counts)
    }
    fn send(&mut self, peer: usize, axis: &str, buf: &[f32]) -> CResult<()> {
        self.host_mut().send(peer, axis, buf)
    }
    fn recv(&mut self, peer: usize, axis: &str, buf: &mut [f32]) -> CResult<()> {
        self.host_mut().recv(peer, axis, buf)
    }
    fn p2p_group(
        &mut self,
        axis: &str,
        sends: &[(usize, &[f32])],
        recvs: &mut [(usize, &mut [f32])],
    ) -> CResult<()> {
        self.host_mut().p2p_group(axis, sends, recvs)
    }
    fn barrier(&mut self, group: &Group) -> CResult<()> {
        self.host_mut().barrier(group)
    }
    fn counts(&self) -> ByteCounts {
        self.host().counts()
    }
    fn abort_handle(&self) -> AbortHandle {
        self.host().abort_handle()
    }
}

/// A device failure inside a communication.
fn internal(e: crate::device::DeviceError) -> CommError {
    CommError::Internal { detail: e.0 }
}

/// Makes the compute stream wait for `done`, an event NCCL's stream records.
fn join(dev: &CudaDevice, done: &CudaEvent, what: &str) -> CResult<()> {
    dev.gpu()
        .stream()
        .wait(done)
        .map_err(|e| CommError::Internal {
            detail: format!("waiting for {what}: {e:?}"),
        })
}

/// Point-to-point transfers through NCCL as one group on NCCL's stream, after the
/// work launched so far; the compute stream, not the host, waits for their end.
fn p2p(dev: &CudaDevice, nccl: &mut NcclComm, axis: &str, ts: &mut [P2p<'_>]) -> CResult<()> {
    let ready = dev.mark().map_err(internal)?;
    let done = nccl.p2p_bf16_device_start(axis, ts, &ready)?;
    join(dev, &done, "point-to-point transfers")
}

/// A collective through NCCL on NCCL's stream, after the work launched so far;
/// the compute stream, not the host, waits for its end.
fn collective<T: crate::comm::Elem>(
    dev: &CudaDevice,
    nccl: &mut NcclComm,
    (kind, on): Kind<'_>,
    src: Option<&CudaSlice<T>>,
    dst: &mut CudaSlice<T>,
) -> CResult<()> {
    let ready = dev.mark().map_err(internal)?;
    let done = nccl.device_start(kind, on, src, dst, &ready)?;
    join(dev, &done, &format!("a {kind}"))
}

impl DeviceComm<CudaDevice> for CudaComm {
    fn all_reduce_start(
        &mut self,
        dev: &CudaDevice,
        on: On<'_>,
        mut buf: CudaSlice<f32>,
    ) -> CResult<Reduction> {
        let host = match self {
            CudaComm::Nccl(nccl) => {
                // On NCCL's stream after the gradients' copy, while the compute
                // stream goes on with the backward.
                let ready = dev.mark().map_err(internal)?;
                let kind = CommKind::AllReduce;
                let done = nccl.device_start(kind, on, None, &mut buf, &ready)?;
                return Ok(Reduction::InFlight { buf, done });
            }
            CudaComm::Staged(host) => host,
        };
        let mut x = dev.f32_download(&buf).map_err(internal)?;
        host.all_reduce(on.0, on.1, &mut x)?;
        Ok(Reduction::Done(dev.f32_upload(&x).map_err(internal)?))
    }
    fn all_reduce_finish(&mut self, dev: &CudaDevice, r: Reduction) -> CResult<CudaSlice<f32>> {
        match r {
            Reduction::Done(buf) => Ok(buf),
            Reduction::InFlight { buf, done } => {
                // The stream, not the host, waits for the sum.
                join(dev, &done, "a reduction")?;
                Ok(buf)
            }
        }
    }
    fn all_reduce_act(
        &mut self,
        dev: &CudaDevice,
        on: On<'_>,
        x: &mut CudaSlice<bf16>,
    ) -> CResult<()> {
        let host = match self {
            CudaComm::Nccl(nccl) => {
                return collective(dev, nccl, (CommKind::AllReduce, on), None, x);
            }
            CudaComm::Staged(host) => host,
        };
        let mut h = dev.act_download(x).map_err(internal)?;
        host.all_reduce(on.0, on.1, &mut h)?;
        upload_act(dev, &h, x)
    }
    fn exchange_act(
        &mut self,
        dev: &CudaDevice,
        axis: &str,
        sends: &[Sent<'_, CudaDevice>],
        recvs: &mut [Recvd<'_, CudaDevice>],
    ) -> CResult<()> {
        if let CudaComm::Nccl(nccl) = self {
            let mut ops: Vec<P2p<'_>> = sends
                .iter()
                .map(|&(to, x, part)| P2p::Send(to, x, part))
                .collect();
            ops.extend(recvs.iter_mut().map(|(from, x)| P2p::Recv(*from, x)));
            return p2p(dev, nccl, axis, &mut ops);
        }
        let down = sends
            .iter()
            .map(|&(to, x, part)| Ok((to, dev.act_download(x).map_err(internal)?, part)))
            .collect::<CResult<Vec<_>>>()?;
        let parts = down
            .iter()
            .map(|(to, h, part)| Ok((*to, part_of(h, *part)?)))
            .collect::<CResult<Vec<_>>>()?;
        let mut got: Vec<Vec<f32>> = recvs.iter().map(|(_, x)| vec![0.0; x.len()]).collect();
        let mut into: Vec<(usize, &mut [f32])> = recvs
            .iter()
            .zip(got.iter_mut())
            .map(|((from, _), g)| (*from, g.as_mut_slice()))
            .collect();
        self.host_mut().p2p_group(axis, &parts, &mut into)?;
        for ((_, x), g) in recvs.iter_mut().zip(&got) {
            upload_act(dev, g, x)?;
        }
        Ok(())
    }
    fn all_to_all_v_act(
        &mut self,
        dev: &CudaDevice,
        (group, axis): On<'_>,
        send: (&CudaSlice<bf16>, &[usize]),
        recv: (&mut CudaSlice<bf16>, &[usize]),
    ) -> CResult<()> {
        let host = match self {
            CudaComm::Nccl(nccl) => {
                let ready = dev.mark().map_err(internal)?;
                let done = nccl.all_to_all_v_bf16_device_start(group, axis, send, recv, &ready)?;
                return join(dev, &done, "the All-to-All");
            }
            CudaComm::Staged(host) => host,
        };
        let h = dev.act_download(send.0).map_err(internal)?;
        let mut got = vec![0.0; recv.0.len()];
        host.all_to_all_v(group, axis, &h, send.1, &mut got, recv.1)?;
        upload_act(dev, &got, recv.0)
    }
    fn act_collective(&mut self, dev: &CudaDevice, k: Kind<'_>, x: &A) -> CResult<A> {
        let len = crate::comm::args::collected_len(k.0, k.1 .0.size(), x.len())?;
        let mut y = dev.act_zeros(len).map_err(internal)?;
        let host = match self {
            CudaComm::Nccl(nccl) => return collective(dev, nccl, k, Some(x), &mut y).map(|_| y),
            CudaComm::Staged(host) => host,
        };
        let h = dev.act_download(x).map_err(internal)?;
        let got = host.collect(k.0, k.1, h)?;
        upload_act(dev, &got, &mut y)?;
        Ok(y)
    }
    fn f32_collective(&mut self, dev: &CudaDevice, k: Kind<'_>, x: &F) -> CResult<F> {
        let host = match self {
            CudaComm::Nccl(nccl) => {
                let len = crate::comm::args::collected_len(k.0, k.1 .0.size(), x.len())?;
                let mut y = dev.f32_zeros(len).map_err(internal)?;
                return collective(dev, nccl, k, Some(x), &mut y).map(|_| y);
            }
            CudaComm::Staged(host) => host,
        };
        let h = dev.f32_download(x).map_err(internal)?;
        let got = host.collect(k.0, k.1, h)?;
        dev.f32_upload(&got).map_err(internal)
    }
}

/// A host vector into a bf16 device buffer (the staged communicator's result).
fn upload_act(dev: &CudaDevice, h: &[f32], out: &mut A) -> CResult<()> {
    let up = dev.f32_upload(h).map_err(internal)?;
    dev.to_act(&up, out).map_err(internal)
}
