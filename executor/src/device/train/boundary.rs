//! Pipeline stage boundaries: the hidden states a task opens with and ends
//! with, their gradients, and their sends and receives between stages.

use super::*;
use crate::device::comm::{Recvd, Sent};
use std::collections::VecDeque;

/// Pipeline stage boundaries between the schedule's exchange points. A rank sends
/// and receives boundaries only there, as one exchange each (one NCCL group): the
/// sends of the tasks since the last point and the receives the tasks up to the
/// next one open with, posted before they run. The points are Megatron-LM's: after
/// each task in the warm-up and the cool-down, after each forward-backward pair in
/// the steady state (its `send_forward_recv_backward` and the like). On NCCL a send
/// may wait until its receive is posted, so two neighbouring stages that each sent
/// on its own before receiving would wait on each other; over these points every
/// schedule the planner writes completes (tests/it/device.rs runs them over sends
/// that wait so).
pub(super) struct Boundaries<D: Device> {
    /// The hidden states a forward task opens with (received, or the last
    /// chunk's output on this rank), and the last segment's output once it ran.
    pub(super) hidden: Option<Arc<D::Act>>,
    /// Their gradient in a backward task, as received or as computed.
    pub(super) grad_hidden: Option<D::Act>,
    held: Vec<HeldSend<D>>,
    /// Received at the last exchange point, in the order the tasks take them.
    posted: VecDeque<D::Act>,
    /// The rank of each pipeline stage at this rank's other coordinates.
    peers: Vec<usize>,
    /// Bytes of an element in the plan's dtype.
    elem: usize,
    /// This rank's place on the tensor axis.
    tp: TpPos,
}

/// A boundary held for the next exchange point.
struct HeldSend<D: Device> {
    stage: u64,
    peer: usize,
    x: Arc<D::Act>,
    /// `(offset, length)` of the part sent.
    part: (usize, usize),
}

impl<D: Device> Boundaries<D> {
    /// The boundaries of the rank at `coords`, whose place on the tensor axis is
    /// `tp`: none yet.
    pub(super) fn of(plan: &Plan, coords: &[u64], tp: TpPos) -> Res<Self> {
        let pp = plan.mesh.axes.iter().position(|a| a == "pp");
        let stages = pp.map_or(0, |i| plan.mesh.shape[i]);
        let peers = (0..stages)
            .map(|s| crate::program::peer_on_stage(plan, coords, s))
            .collect::<Res<_>>()?;
        Ok(Boundaries {
            hidden: None,
            grad_hidden: None,
            held: Vec::new(),
            posted: VecDeque::new(),
            peers,
            elem: plan.model.dtype.size_bytes() as usize,
            tp,
        })
    }

    fn peer(&self, stage: u64) -> Res<usize> {
        (self.peers.get(stage as usize).copied())
            .ok_or_else(|| fail(format!("the mesh has no pipeline stage {stage}")))
    }

    /// Elements of a boundary of `bytes` in the plan's dtype.
    fn len(&self, bytes: f64) -> usize {
        (bytes / self.elem as f64) as usize
    }

    /// Holds the stage boundary (the hidden states forward, their gradient
    /// backward) for stage `stage` until the schedule's next exchange point:
    /// whole, or this tensor rank's slice of it when the plan scatters the
    /// boundary over the tensor axis (the receiver gathers).
    pub(super) fn send(&mut self, stage: u64, bytes: f64, grad: bool) -> Res {
        let peer = self.peer(stage)?;
        let n = self.len(bytes);
        let x = if grad {
            self.grad_hidden.take().map(Arc::new)
        } else {
            self.hidden.clone()
        }
        .ok_or_else(|| fail("no boundary to send"))?;
        let len = D::act_len(&x);
        let off = if n == len {
            0
        } else if n * self.tp.size == len {
            self.tp.rank * n
        } else {
            return Err(fail(format!(
                "a boundary of {len} values cannot be sent as {n} per rank over tp={}",
                self.tp.size
            )));
        };
        self.held.push(HeldSend {
            stage,
            peer,
            x,
            part: (off, n),
        });
        Ok(())
    }

    /// Takes the stage boundary from stage `stage`, received at the exchange point
    /// before this task.
    pub(super) fn recv(&mut self, stage: u64, bytes: f64, grad: bool) -> Res {
        let n = self.len(bytes);
        let x = self.posted.pop_front().ok_or_else(|| {
            fail(format!(
                "a receive from stage {stage} that no exchange point posted"
            ))
        })?;
        if D::act_len(&x) != n {
            return Err(fail(format!(
                "the boundary received from stage {stage} holds {} values, the task takes {n}",
                D::act_len(&x)
            )));
        }
        self.set(grad, x);
        Ok(())
    }

    /// The boundary a task opens with: the hidden state, or its gradient.
    fn set(&mut self, grad: bool, x: D::Act) {
        if grad {
            self.grad_hidden = Some(x);
        } else {
            self.hidden = Some(Arc::new(x));
        }
    }

    /// An exchange point of the schedule: the boundaries held since the last one
    /// go out, and those the tasks up to the next point open with (`recvs`: each
    /// one's stage and bytes) come in, as one exchange, traced on `meter`.
    pub(super) fn exchange(
        &mut self,
        (dev, comm): (&D, &mut D::Comm),
        recvs: &[(u64, f64)],
        meter: &mut Meter<D>,
    ) -> Res {
        let mut recvs = (recvs.iter())
            .map(|&(stage, bytes)| {
                let x = dev.act_zeros(self.len(bytes)).map_err(derr("alloc"))?;
                Ok((stage, self.peer(stage)?, x))
            })
            .collect::<Res<Vec<_>>>()?;
        let held = std::mem::take(&mut self.held);
        if held.is_empty() && recvs.is_empty() {
            return Ok(());
        }
        let m0 = meter.mark(dev)?;
        let sends: Vec<Sent<'_, D>> = held.iter().map(|h| (h.peer, &*h.x, h.part)).collect();
        let mut into: Vec<Recvd<'_, D>> = recvs.iter_mut().map(|r| (r.1, &mut r.2)).collect();
        comm.exchange_act(dev, "pp", &sends, &mut into)?;
        let mut name: Vec<String> = held
            .iter()
            .map(|h| format!("send to stage {}", h.stage))
            .collect();
        name.extend(recvs.iter().map(|r| format!("recv from stage {}", r.0)));
        let sent: usize = held.iter().map(|h| h.part.1).sum();
        let got: usize = recvs.iter().map(|r| D::act_len(&r.2)).sum();
        let args = serde_json::json!({
            "step": meter.step_no,
            "bytes": (sent + got) * self.elem,
            "peers": held.iter().map(|h| h.peer).chain(recvs.iter().map(|r| r.1)).collect::<Vec<_>>(),
        });
        self.posted.extend(recvs.into_iter().map(|r| r.2));
        meter.span(dev, m0, name.join(", "), ("p2p", args))
    }

    /// Gathers over `(g, axis)` a boundary received in tensor-rank slices.
    pub(super) fn gather(
        &mut self,
        (dev, comm): (&D, &mut D::Comm),
        (g, axis): (&Group, &str),
        grad: bool,
    ) -> Res {
        let local: &D::Act = if grad {
            self.grad_hidden.as_ref()
        } else {
            self.hidden.as_deref()
        }
        .ok_or_else(|| fail("no boundary to gather"))?;
        let out = comm.act_collective(dev, (CommKind::AllGather, (g, axis)), local)?;
        self.set(grad, out);
        Ok(())
    }
}
