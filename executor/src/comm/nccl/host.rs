//! The [`Communicator`] on host slices: each call stages its buffers through
//! device memory and runs NCCL on the communication stream.

use super::*;

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
        self.run(kind, axis, |s| {
            let mut d = s.stage(buf.len(), Some(buf))?;
            let p = ptr_mut(&mut d, &s.stream, 0);
            // SAFETY: `d` holds `buf.len()` floats (at least one) and lives past the sync.
            nccl_call("ncclAllReduce", unsafe {
                result::all_reduce(p, p, buf.len(), F32, SUM, comm, s.raw_stream())
            })?;
            s.fetch(&d, buf)
        })?;
        self.counts
            .record_ring(kind, axis, group.size(), bytes_of(buf.len()));
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
        args::gather_scatter(kind, n, local.len(), out.len())?;
        let (_, comm) = self.group_comm(group, kind, axis)?;
        self.run(kind, axis, |s| {
            let src = s.stage(local.len(), Some(local))?;
            let mut dst = s.stage(out.len(), None)?;
            let (ps, pd) = (ptr(&src, &s.stream, 0), ptr_mut(&mut dst, &s.stream, 0));
            // SAFETY: sizes as checked above.
            nccl_call("ncclAllGather", unsafe {
                result::all_gather(ps, pd, local.len(), F32, comm, s.raw_stream())
            })?;
            s.fetch(&dst, out)
        })?;
        self.counts.record_ring(kind, axis, n, bytes_of(out.len()));
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
        args::gather_scatter(kind, n, input.len(), out.len())?;
        let (_, comm) = self.group_comm(group, kind, axis)?;
        self.run(kind, axis, |s| {
            let src = s.stage(input.len(), Some(input))?;
            let mut dst = s.stage(out.len(), None)?;
            let (ps, pd) = (ptr(&src, &s.stream, 0), ptr_mut(&mut dst, &s.stream, 0));
            // SAFETY: sizes as checked above.
            nccl_call("ncclReduceScatter", unsafe {
                result::reduce_scatter(ps, pd, out.len(), F32, SUM, comm, s.raw_stream())
            })?;
            s.fetch(&dst, out)
        })?;
        self.counts
            .record_ring(kind, axis, n, bytes_of(input.len()));
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
        self.run(kind, axis, |s| {
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
        self.counts.record_ring(kind, axis, n, bytes_of(buf.len()));
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
        self.run(kind, axis, |s| {
            grouped_exchange(s, comm, (send, &counts), (recv, &counts))
        })?;
        self.counts.record_ring(kind, axis, n, bytes_of(send.len()));
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
        self.run(kind, axis, |s| {
            grouped_exchange(s, comm, (send, send_counts), (recv, recv_counts))
        })?;
        self.counts
            .record_a2av(axis, send.len(), (me, send_counts), 4);
        Ok(())
    }

    fn send(&mut self, peer: usize, axis: &str, buf: &[f32]) -> Result<(), CommError> {
        self.p2p_group(axis, &[(peer, buf)], &mut [])
    }

    fn recv(&mut self, peer: usize, axis: &str, buf: &mut [f32]) -> Result<(), CommError> {
        self.p2p_group(axis, &[], &mut [(peer, buf)])
    }

    fn p2p_group(
        &mut self,
        axis: &str,
        sends: &[(usize, &[f32])],
        recvs: &mut [(usize, &mut [f32])],
    ) -> Result<(), CommError> {
        for &(to, _) in sends {
            self.check_peer(CommKind::Send, to)?;
        }
        for (from, _) in recvs.iter() {
            self.check_peer(CommKind::Recv, *from)?;
        }
        let kind = if sends.is_empty() {
            CommKind::Recv
        } else {
            CommKind::Send
        };
        self.check_aborted(kind, axis, "p2p")?;
        let comm = self.world_comm.0;
        let empty =
            sends.iter().all(|(_, x)| x.is_empty()) && recvs.iter().all(|(_, x)| x.is_empty());
        // Nothing to move: no staging and no sync, only the counts.
        if !empty {
            self.run(kind, axis, |s| {
                let src = sends
                    .iter()
                    .map(|(_, x)| s.stage(x.len(), Some(x)))
                    .collect::<Result<Vec<_>, _>>()?;
                let mut dst = recvs
                    .iter()
                    .map(|(_, x)| s.stage(x.len(), None))
                    .collect::<Result<Vec<_>, _>>()?;
                // One group: sends and receives that wait on each other across two
                // ranks all complete.
                in_group(|| {
                    for ((to, x), d) in sends.iter().zip(&src) {
                        if x.is_empty() {
                            continue;
                        }
                        let p = ptr(d, &s.stream, 0);
                        // SAFETY: `d` holds `x.len()` floats and lives past the sync.
                        nccl_call("ncclSend", unsafe {
                            result::send(p, x.len(), F32, *to as i32, comm, s.raw_stream())
                        })?;
                    }
                    for ((from, x), d) in recvs.iter().zip(dst.iter_mut()) {
                        if x.is_empty() {
                            continue;
                        }
                        let p = ptr_mut(d, &s.stream, 0);
                        // SAFETY: as for a send.
                        nccl_call("ncclRecv", unsafe {
                            result::recv(p, x.len(), F32, *from as i32, comm, s.raw_stream())
                        })?;
                    }
                    Ok(())
                })?;
                s.sync()?;
                for ((_, x), d) in recvs.iter_mut().zip(&dst) {
                    s.fetch(d, x)?;
                }
                Ok(())
            })?;
        }
        for (_, x) in sends {
            self.counts
                .record_p2p(CommKind::Send, axis, bytes_of(x.len()));
        }
        for (_, x) in recvs.iter() {
            self.counts
                .record_p2p(CommKind::Recv, axis, bytes_of(x.len()));
        }
        Ok(())
    }

    fn barrier(&mut self, group: &Group) -> Result<(), CommError> {
        let kind = CommKind::Barrier;
        let (_, comm) = self.group_comm(group, kind, &group.id)?;
        self.run(kind, &group.id, |s| {
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

    fn abort_handle(&self) -> AbortHandle {
        let (abort, ctx) = (Arc::clone(&self.abort), Arc::clone(&self.ctx));
        AbortHandle::new(move |first_rank, reason| {
            let mut a = abort.lock().unwrap_or_else(PoisonError::into_inner);
            if a.failure.is_some() {
                return;
            }
            a.failure = Some((first_rank, reason));
            // Peers blocked in a collective with this rank get an error instead of
            // a hang: NCCL's kernels watch the abort flag, so a stream waiting on
            // one completes (the watchdog of PyTorch's NCCL process group aborts
            // communicators in use on other threads the same way). A call still
            // being enqueued on the owner's thread can race with the free: the
            // owner checks the flag before each call, not during one.
            let _ = ctx.bind_to_thread();
            for c in a.comms.drain(..) {
                // SAFETY: live (Drop takes the handles under this lock before it
                // destroys them) and aborted once (drained).
                let _ = unsafe { result::comm_abort(c.0) };
            }
        })
    }
}

impl NcclComm {
    pub(super) fn check_peer(&self, kind: CommKind, peer: usize) -> Result<(), CommError> {
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
    {
        let ((ps, _gs), (pr, _gr)) = (src.device_ptr(&s.stream), dst.device_ptr_mut(&s.stream));
        let on = (comm, s.raw_stream());
        // SAFETY: the counts were checked against the buffers by the caller; both
        // are staged copies alive until the fetch below, which synchronises.
        in_group(|| unsafe { exchange_runs((ps, send_counts), (pr, recv_counts), (F32, 4), on) })?;
    }
    s.fetch(&dst, recv)
}
