//! NCCL on device buffers: collectives, All-to-All(v) and point-to-point transfers
//! of GPU memory on the communication stream, joined to the caller's stream by
//! events, counted as the host collectives count theirs.

use super::*;

/// An element type of NCCL's collectives on device buffers.
pub trait Elem: DeviceRepr {
    /// NCCL's name for it.
    const DTYPE: sys::ncclDataType_t;
}

impl Elem for f32 {
    const DTYPE: sys::ncclDataType_t = F32;
}

impl Elem for bf16 {
    const DTYPE: sys::ncclDataType_t = BF16;
}

impl NcclComm {
    /// A collective on device buffers of `T`, on the communication stream once
    /// `ready` (recorded on the stream that wrote the buffers) has passed: an
    /// in-place all-reduce of `dst` (`src` `None`), a reduce-scatter of `src` into
    /// `dst`, or an all-gather of `src` into `dst`. Summed in `T` as NCCL sums it;
    /// bytes counted at 4 an element, as the host collectives count theirs. The
    /// returned event marks its end: the consumer's stream waits on it, and the
    /// host waits for neither. The buffers stay alive, and unwritten, until it has
    /// passed.
    pub fn device_start<T: Elem>(
        &mut self,
        kind: CommKind,
        (group, axis): (&Group, &str),
        src: Option<&CudaSlice<T>>,
        dst: &mut CudaSlice<T>,
        ready: &CudaEvent,
    ) -> Result<CudaEvent, CommError> {
        let (n_in, n_out) = (src.map_or(dst.len(), |s| s.len()), dst.len());
        let members = group.size();
        match kind {
            CommKind::AllReduce if n_in == n_out => {}
            CommKind::ReduceScatter | CommKind::AllGather => {
                args::gather_scatter(kind, members, n_in, n_out)?
            }
            _ => {
                return Err(CommError::Internal {
                    detail: format!("{kind} of {n_in} into {n_out} elements on device buffers"),
                })
            }
        }
        let (_, comm) = self.group_comm(group, kind, axis)?;
        let done = self.run(kind, axis, |s| {
            s.stream
                .wait(ready)
                .map_err(|e| format!("waiting for the buffer's writer: {e:?}"))?;
            if n_out > 0 {
                // The guards record the buffers' use on this stream when they drop,
                // so they are held until the collective is enqueued after them.
                let (pd, _gd) = dst.device_ptr_mut(&s.stream);
                let (ps, _gs) = match src {
                    Some(x) => {
                        let (p, g) = x.device_ptr(&s.stream);
                        (p, Some(g))
                    }
                    None => (pd, None),
                };
                let (ps, pd) = (ps as *const c_void, pd as *mut c_void);
                let (raw, dtype) = (s.raw_stream(), T::DTYPE);
                // SAFETY: `ps` holds `n_in` and `pd` `n_out` elements of `T`, as the
                // collective's shape was checked above; the caller keeps both alive
                // and unwritten until the returned event has passed.
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
        self.counts
            .record_ring(kind, axis, members, bytes_of(n_in.max(n_out)));
        Ok(done)
    }

    /// All-to-All with uneven splits of bf16 device buffers (expert parallelism's
    /// token rows): `send_counts[j]` elements to member `j` from `send`, in group
    /// order, `recv_counts[i]` from member `i` into `recv`; one NCCL group of
    /// sends and receives on the communication stream after `ready`. Counted as
    /// the host's `all_to_all_v` counts (what leaves for the other members), at
    /// four bytes an element as the host counts.
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
        let done = self.run(kind, axis, |s| {
            s.stream
                .wait(ready)
                .map_err(|e| format!("waiting for the buffers' writer: {e:?}"))?;
            let raw = s.raw_stream();
            let (ps, _gs) = send.device_ptr(&s.stream);
            let (pr, _gr) = recv.device_ptr_mut(&s.stream);
            // SAFETY: the counts were checked against the buffers; both stay alive
            // until the returned event (`recv` borrowed mutably).
            in_group(|| unsafe {
                exchange_runs((ps, send_counts), (pr, recv_counts), (BF16, 2), (comm, raw))
            })?;
            s.stream
                .record_event(None)
                .map_err(|e| format!("recording the exchange's end: {e:?}"))
        })?;
        self.counts
            .record_a2av(axis, send.len(), (me, send_counts), 4);
        Ok(done)
    }

    /// Point-to-point transfers of bf16 device buffers (a pipeline schedule's
    /// exchange point, ring attention's blocks) as one NCCL group on the
    /// communication stream, after `ready`: sends and receives that wait on each
    /// other across ranks complete together. The returned event marks the group's
    /// end; the buffers stay alive and unwritten until it has passed. Bytes counted
    /// at four per element, as every communicator counts (a run's report restates
    /// them at the plan's dtype).
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
        let done = self.run(CommKind::Send, axis, |s| {
            s.stream
                .wait(ready)
                .map_err(|e| format!("waiting for the buffers' writer: {e:?}"))?;
            let raw = s.raw_stream();
            // Held until the group is enqueued, which is when NCCL reads the
            // pointers onto the stream.
            let mut guards: Vec<SyncOnDrop<'_>> = Vec::new();
            let status = in_group(|| {
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
                            let p = p as *mut c_void;
                            // SAFETY: as for a send; `buf` is borrowed mutably.
                            unsafe { result::recv(p, n, BF16, *peer as i32, comm, raw) }
                        }
                    };
                    nccl_call("nccl p2p", r)?;
                }
                Ok(())
            });
            drop(guards);
            status?;
            s.stream
                .record_event(None)
                .map_err(|e| format!("recording the transfers' end: {e:?}"))
        })?;
        for t in transfers.iter() {
            match t {
                P2p::Send(_, _, (_, n)) => {
                    self.counts.record_p2p(CommKind::Send, axis, bytes_of(*n))
                }
                P2p::Recv(_, buf) => {
                    self.counts
                        .record_p2p(CommKind::Recv, axis, bytes_of(buf.len()))
                }
            }
        }
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
