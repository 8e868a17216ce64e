//! [`ThreadComm`]'s collectives and point-to-point transfers over the rendezvous of
//! `thread.rs`: what each member reads of the others' inputs, sums in group order.

use super::*;

/// `len` elements of a member's input from `offset`, or an error instead of a panic
/// if a peer's input is shorter than agreed.
fn part<'a>(
    c: &'a Contribution,
    offset: usize,
    len: usize,
    wait: &WaitPoint,
) -> Result<&'a [f32], CommError> {
    c.data
        .get(offset..offset + len)
        .ok_or_else(|| CommError::Internal {
            detail: format!("{wait}: a member's input is shorter than agreed"),
        })
}

/// `out` = sum over members, in group order, of `out.len()` elements from `offset`.
/// Every member runs this same loop on the same inputs, so all get the same bits.
fn sum_into(
    out: &mut [f32],
    inputs: &[Arc<Contribution>],
    offset: usize,
    wait: &WaitPoint,
) -> Result<(), CommError> {
    let Some((first, rest)) = inputs.split_first() else {
        return Ok(());
    };
    out.copy_from_slice(part(first, offset, out.len(), wait)?);
    add_rest(out, rest, offset, wait)
}

/// [`sum_into`] into a new vector of `len` elements.
fn summed(
    inputs: &[Arc<Contribution>],
    (offset, len): (usize, usize),
    wait: &WaitPoint,
) -> Result<Vec<f32>, CommError> {
    let Some((first, rest)) = inputs.split_first() else {
        return Ok(Vec::new());
    };
    let mut out = part(first, offset, len, wait)?.to_vec();
    add_rest(&mut out, rest, offset, wait)?;
    Ok(out)
}

/// Adds each of `rest`'s `out.len()` elements from `offset` to `out`, in order.
fn add_rest(
    out: &mut [f32],
    rest: &[Arc<Contribution>],
    offset: usize,
    wait: &WaitPoint,
) -> Result<(), CommError> {
    let len = out.len();
    for c in rest {
        for (o, x) in out.iter_mut().zip(part(c, offset, len, wait)?) {
            *o += *x;
        }
    }
    Ok(())
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn all_reduce(&mut self, group: &Group, axis: &str, buf: &mut [f32]) -> Result<(), CommError> {
        self.checked(|s| {
            let (me, wait) = s.enter(group, CommKind::AllReduce, axis)?;
            let mine = Contribution::of(buf);
            let inputs = s.exchange(me, &wait, buf.len(), 0, mine)?;
            sum_into(buf, &inputs, 0, &wait)?;
            s.counts
                .record_ring(CommKind::AllReduce, axis, group.size(), bytes_of(buf.len()));
            Ok(())
        })
    }

    fn all_gather(
        &mut self,
        group: &Group,
        axis: &str,
        local: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        let on = (group, axis);
        self.gather_scatter(
            CommKind::AllGather,
            on,
            (Contribution::of(local), out.len()),
            |inputs, _, wait| {
                if !local.is_empty() {
                    for (dst, c) in out.chunks_mut(local.len()).zip(inputs) {
                        dst.copy_from_slice(part(c, 0, dst.len(), wait)?);
                    }
                }
                Ok(())
            },
        )
    }

    fn reduce_scatter(
        &mut self,
        group: &Group,
        axis: &str,
        input: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        let kind = CommKind::ReduceScatter;
        self.gather_scatter(
            kind,
            (group, axis),
            (Contribution::of(input), out.len()),
            |inputs, me, wait| sum_into(out, inputs, me * out.len(), wait),
        )
    }

    fn collect(
        &mut self,
        kind: CommKind,
        on: (&Group, &str),
        src: Vec<f32>,
    ) -> Result<Vec<f32>, CommError> {
        let (n_src, len) = (
            src.len(),
            args::collected_len(kind, on.0.size(), src.len())?,
        );
        let mine = Contribution {
            data: src,
            ..Contribution::default()
        };
        self.gather_scatter(kind, on, (mine, len), |inputs, me, wait| {
            if kind == CommKind::ReduceScatter {
                return summed(inputs, (me * len, len), wait);
            }
            let mut out = Vec::with_capacity(len);
            for c in inputs {
                out.extend_from_slice(part(c, 0, n_src, wait)?);
            }
            Ok(out)
        })
    }

    fn broadcast(
        &mut self,
        group: &Group,
        axis: &str,
        buf: &mut [f32],
        root_index: usize,
    ) -> Result<(), CommError> {
        self.checked(|s| {
            let n = group.size();
            args::broadcast(n, root_index)?;
            let (me, wait) = s.enter(group, CommKind::Broadcast, axis)?;
            // Only the root's data is read, so the others contribute nothing.
            let mine = Contribution::of(if me == root_index { buf } else { &[] });
            let inputs = s.exchange(me, &wait, buf.len(), root_index, mine)?;
            if me != root_index {
                let root = inputs.get(root_index).ok_or_else(|| CommError::Internal {
                    detail: format!("{wait} has no root input"),
                })?;
                buf.copy_from_slice(part(root, 0, buf.len(), &wait)?);
            }
            s.counts
                .record_ring(CommKind::Broadcast, axis, n, bytes_of(buf.len()));
            Ok(())
        })
    }

    fn all_to_all(
        &mut self,
        group: &Group,
        axis: &str,
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), CommError> {
        self.checked(|s| {
            let n = group.size();
            args::all_to_all(n, send.len(), recv.len())?;
            let (me, wait) = s.enter(group, CommKind::AllToAll, axis)?;
            let mine = Contribution::of(send);
            let inputs = s.exchange(me, &wait, send.len(), 0, mine)?;
            let p = send.len() / n;
            if p > 0 {
                for (dst, c) in recv.chunks_mut(p).zip(&inputs) {
                    dst.copy_from_slice(part(c, me * p, p, &wait)?);
                }
            }
            s.counts
                .record_ring(CommKind::AllToAll, axis, n, bytes_of(send.len()));
            Ok(())
        })
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
        self.checked(|s| {
            let n = group.size();
            args::all_to_all_v(n, (send.len(), send_counts), (recv.len(), recv_counts))?;
            let (me, wait) = s.enter(group, CommKind::AllToAllV, axis)?;
            let mine = Contribution {
                data: send.to_vec(),
                send_counts: send_counts.to_vec(),
                recv_counts: recv_counts.to_vec(),
            };
            // Sizes legitimately differ between members; the counts are checked against
            // each other once everyone has arrived.
            let inputs = s.exchange(me, &wait, 0, 0, mine)?;
            let mut at = 0;
            for (c, &count) in inputs.iter().zip(recv_counts) {
                let offset: usize = c.send_counts.iter().take(me).sum();
                let src = part(c, offset, count, &wait)?;
                let dst = recv
                    .get_mut(at..at + count)
                    .ok_or_else(|| CommError::Internal {
                        detail: format!("{wait}: receive window out of range"),
                    })?;
                dst.copy_from_slice(src);
                at += count;
            }
            s.counts.record_a2av(axis, send.len(), (me, send_counts), 4);
            Ok(())
        })
    }

    fn send(&mut self, peer: usize, axis: &str, buf: &[f32]) -> Result<(), CommError> {
        self.checked(|s| {
            s.check_peer(CommKind::Send, peer)?;
            let seq = s.send_seq.entry(peer).or_insert(0);
            let wait = next_wait(seq, CommKind::Send, axis, "p2p", vec![s.rank, peer]);
            let mut st = s.shared.lock()?;
            if let Some(f) = &st.failure {
                return Err(aborted(f, &wait));
            }
            st.mail
                .entry((s.rank, peer))
                .or_default()
                .push_back(Message {
                    axis: axis.to_string(),
                    data: buf.to_vec(),
                });
            st.moved();
            drop(st);
            s.shared.wake.notify_all();
            s.counts
                .record_p2p(CommKind::Send, axis, bytes_of(buf.len()));
            Ok(())
        })
    }

    fn recv(&mut self, peer: usize, axis: &str, buf: &mut [f32]) -> Result<(), CommError> {
        self.checked(|s| {
            s.check_peer(CommKind::Recv, peer)?;
            let seq = s.recv_seq.entry(peer).or_insert(0);
            let wait = next_wait(seq, CommKind::Recv, axis, "p2p", vec![peer, s.rank]);
            let deadline = s.deadline();
            let mut st = s.shared.lock()?;
            let msg = loop {
                if let Some(f) = &st.failure {
                    return Err(aborted(f, &wait));
                }
                if let Some(m) = st
                    .mail
                    .get_mut(&(peer, s.rank))
                    .and_then(VecDeque::pop_front)
                {
                    break m;
                }
                if st.finished.get(peer).copied().unwrap_or(false) {
                    return Err(CommError::Unmatched {
                        waiting_in: wait,
                        finished: vec![peer],
                    });
                }
                let (guard, in_time) = s.shared.wait(st, (s.rank, &wait), deadline)?;
                st = guard;
                if !in_time {
                    return Err(timeout(&wait, vec![peer], s.timeout));
                }
            };
            drop(st);
            if msg.data.len() != buf.len() || msg.axis != axis {
                return Err(CommError::Mismatch {
                    detail: format!(
                        "rank {peer} sent {} elements on {} but rank {} receives {} on {axis}",
                        msg.data.len(),
                        msg.axis,
                        s.rank,
                        buf.len()
                    ),
                    waiting_in: wait,
                });
            }
            buf.copy_from_slice(&msg.data);
            s.counts
                .record_p2p(CommKind::Recv, axis, bytes_of(buf.len()));
            Ok(())
        })
    }

    fn barrier(&mut self, group: &Group) -> Result<(), CommError> {
        self.checked(|s| {
            let (me, wait) = s.enter(group, CommKind::Barrier, &group.id)?;
            s.exchange(me, &wait, 0, 0, Contribution::default())?;
            Ok(())
        })
    }

    fn counts(&self) -> ByteCounts {
        self.counts.clone()
    }

    fn abort_handle(&self) -> AbortHandle {
        let shared = Arc::clone(&self.shared);
        AbortHandle::new(move |rank, reason| shared.abort(rank, reason))
    }
}

#[cfg(test)]
impl ThreadComm {
    /// The world's first failure, if any.
    pub fn failure(&self) -> Option<Failure> {
        let st = self.shared.state.lock();
        st.unwrap_or_else(PoisonError::into_inner).failure.clone()
    }
}
