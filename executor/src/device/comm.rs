//! Moving a device's buffers between ranks. [`DeviceComm`] is the communicator
//! trait on a device's own buffers: each [`Device`] names the communicator its
//! ranks hold ([`Device::Comm`]). The host devices' is any host communicator (the
//! in-process one, or a launched process's), which works on their vectors
//! directly; the CUDA device's is `cuda::CudaComm`, NCCL on GPU memory (or a host
//! communicator through which ranks sharing one GPU stage their buffers).

use super::{Device, HostPrecision};
use crate::comm::{CommError, CommKind, Communicator, Group};
use crate::device::Buffers;

/// Result of a communication.
pub type CResult<T> = Result<T, CommError>;

/// Where a collective runs: its group, and the axis label its bytes count under.
pub type On<'a> = (&'a Group, &'a str);

/// Collectives and point-to-point transfers on the buffers of device `D`, with the
/// byte counts of the host [`Communicator`] the trait extends.
pub trait DeviceComm<D: Device + ?Sized>: Communicator {
    /// Starts summing `buf` over `on`, after the work launched so far; the
    /// interpreter issues a gradient bucket as soon as its gradients are final, so
    /// that a device with a collective engine of its own overlaps it with the rest
    /// of the backward.
    fn all_reduce_start(&mut self, dev: &D, on: On<'_>, buf: D::F32) -> CResult<D::Reduction>;
    /// The summed buffer of a reduction [`DeviceComm::all_reduce_start`] began,
    /// ready for the work launched after this call.
    fn all_reduce_finish(&mut self, dev: &D, r: D::Reduction) -> CResult<D::F32>;

    /// Sums the activation (or activation gradient) `x` over `on` in place: tensor
    /// parallelism's partial sums.
    fn all_reduce_act(&mut self, dev: &D, on: On<'_>, x: &mut D::Act) -> CResult<()>;

    /// Sends `x[off..off + n]` to rank `peer` (an inference pipeline's boundary, a
    /// KV cache), counted under `axis`: an exchange of one send.
    fn send_act(
        &mut self,
        dev: &D,
        to: (usize, &str),
        x: &D::Act,
        n: (usize, usize),
    ) -> CResult<()> {
        self.exchange_act(dev, to.1, &[(to.0, x, n)], &mut [])
    }
    /// Receives `out` (its length) from rank `peer`, counted under `axis`: an
    /// exchange of one receive.
    fn recv_act(&mut self, dev: &D, from: (usize, &str), out: &mut D::Act) -> CResult<()> {
        self.exchange_act(dev, from.1, &[], &mut [(from.0, out)])
    }

    /// Sends each `(to, x, (off, n))` of `sends` (`x[off..off + n]` to rank `to`)
    /// and receives each `(from, out)` of `recvs` (`out`'s length from rank
    /// `from`), as one exchange: a ring's step, or a pipeline schedule's exchange
    /// point. On NCCL one group, so that two ranks that each send to the other
    /// before they receive do not wait on each other (see
    /// [`Communicator::p2p_group`]).
    fn exchange_act(
        &mut self,
        dev: &D,
        axis: &str,
        sends: &[Sent<'_, D>],
        recvs: &mut [Recvd<'_, D>],
    ) -> CResult<()>;

    /// All-to-All with uneven splits over `on`: `send.1[j]` elements of `send.0` to
    /// member `j`, `recv.1[i]` from member `i` into `recv.0`, both in group order
    /// (expert parallelism's token rows).
    fn all_to_all_v_act(
        &mut self,
        dev: &D,
        on: On<'_>,
        send: (&D::Act, &[usize]),
        recv: (&mut D::Act, &[usize]),
    ) -> CResult<()>;

    /// Sequence parallelism's collectives on activations (and input gradients),
    /// `k` = (kind, where), into a new buffer: `ReduceScatter` (this member's rows
    /// of the sum of every member's `x`) or `AllGather` (every member's `x`, in
    /// group order).
    fn act_collective(&mut self, dev: &D, k: Kind<'_>, x: &D::Act) -> CResult<D::Act>;

    /// ZeRO's collectives on fp32 buffers, `k` = (kind, where), into a new buffer:
    /// `ReduceScatter` (this member's part of the sum of the gradient shards) or
    /// `AllGather` (every member's updated parameters).
    fn f32_collective(&mut self, dev: &D, k: Kind<'_>, x: &D::F32) -> CResult<D::F32>;

    /// [`f32_collective`](Self::f32_collective) of a buffer the caller gives up (a
    /// gradient bucket, a part packed for the gather): the in-process communicator
    /// then hands it to its peers as it is instead of copying it.
    fn f32_collective_owned(&mut self, dev: &D, k: Kind<'_>, x: D::F32) -> CResult<D::F32> {
        self.f32_collective(dev, k, &x)
    }
}

/// A part of a buffer sent in an exchange: to whom, the buffer, `(offset, length)`.
pub type Sent<'a, D> = (usize, &'a <D as Buffers>::Act, (usize, usize));

/// A buffer received in an exchange, and from whom.
pub type Recvd<'a, D> = (usize, &'a mut <D as Buffers>::Act);

/// A reduce-scatter or an all-gather, and where it runs.
pub type Kind<'a> = (CommKind, On<'a>);

/// `x[off..off + len]`, or an error naming a range `x` does not hold.
pub(crate) fn part_of(x: &[f32], (off, len): (usize, usize)) -> CResult<&[f32]> {
    x.get(off..off + len).ok_or_else(|| CommError::Internal {
        detail: format!("sending {off}..{} of {}", off + len, x.len()),
    })
}

/// A host device's buffer.
type V = Vec<f32>;

/// A host device's buffers are host vectors: any host communicator moves them as
/// they are, rounding a sum to bf16 where a GPU would store it in bf16.
impl<H: HostPrecision> DeviceComm<H> for dyn Communicator {
    fn all_reduce_start(
        &mut self,
        _: &H,
        (g, axis): On<'_>,
        mut buf: Vec<f32>,
    ) -> CResult<Vec<f32>> {
        self.all_reduce(g, axis, &mut buf)?;
        Ok(buf)
    }
    fn all_reduce_finish(&mut self, _: &H, r: Vec<f32>) -> CResult<Vec<f32>> {
        Ok(r)
    }
    fn all_reduce_act(&mut self, _: &H, (g, axis): On<'_>, x: &mut Vec<f32>) -> CResult<()> {
        self.all_reduce(g, axis, x)?;
        // The sum lands in a bf16 buffer on a GPU.
        H::round(x);
        Ok(())
    }
    fn exchange_act(
        &mut self,
        _: &H,
        axis: &str,
        sends: &[Sent<'_, H>],
        recvs: &mut [Recvd<'_, H>],
    ) -> CResult<()> {
        let parts = sends
            .iter()
            .map(|&(to, x, part)| Ok((to, part_of(x, part)?)))
            .collect::<CResult<Vec<_>>>()?;
        let mut into: Vec<(usize, &mut [f32])> = recvs
            .iter_mut()
            .map(|(from, x)| (*from, x.as_mut_slice()))
            .collect();
        self.p2p_group(axis, &parts, &mut into)
    }
    fn all_to_all_v_act(
        &mut self,
        _: &H,
        (group, axis): On<'_>,
        (send, send_counts): (&Vec<f32>, &[usize]),
        (recv, recv_counts): (&mut Vec<f32>, &[usize]),
    ) -> CResult<()> {
        self.all_to_all_v(group, axis, send, send_counts, recv, recv_counts)
    }
    fn act_collective(&mut self, _: &H, (kind, on): Kind<'_>, x: &V) -> CResult<V> {
        let mut y = self.collect(kind, on, x.clone())?;
        // A reduce-scatter's sum lands in a bf16 buffer on a GPU.
        if kind == CommKind::ReduceScatter {
            H::round(&mut y);
        }
        Ok(y)
    }
    fn f32_collective(&mut self, _: &H, (kind, on): Kind<'_>, x: &V) -> CResult<V> {
        self.collect(kind, on, x.clone())
    }
    fn f32_collective_owned(&mut self, _: &H, (kind, on): Kind<'_>, x: V) -> CResult<V> {
        self.collect(kind, on, x)
    }
}
