//! Routed experts, shared by the training and inference interpreters: top-k routing,
//! tokens grouped by expert, sent to the ranks holding their experts (All-to-All with
//! the actual counts, or buffers padded to expert capacity), each expert's gated MLP,
//! and the weighted combine back in token order.
//!
//! Both interpreters run an experts op's forward as [`Exec::forward`] on their
//! device; the training interpreter keeps its [`Kept`] state for the backward
//! (`device/train/experts.rs`), which moves the gradients as the tokens moved
//! ([`Exec::send_to_experts`], [`Exec::bring_back`]).
//!
//! The counts (and, under a capacity, the slot order) come to the host: they size
//! the exchange. The rows stay on the device; the route and padding become index
//! lists that [`Device::gather_rows`] applies.

use crate::comm::{Communicator, Group, RankError};
use crate::device::{derr, DResult, Device, DeviceComm, Routed};
use crate::shard::TpPos;
use crate::train::fail;
use meshplan_ir::graph::ExpertsShape;
use meshplan_kernels::cpu::{Capacity, GemmAt, MoeDims, Transpose};

/// Where one rank runs an experts op: its positions on the tensor and expert axes,
/// and its expert group (`None` when the experts are not split over ranks).
pub(crate) struct Place<'g> {
    pub tp: TpPos,
    pub ep: TpPos,
    pub group: Option<&'g Group>,
}

impl Place<'_> {
    fn ep_group(&self) -> Result<&Group, RankError> {
        self.group
            .ok_or_else(|| fail("experts split over ep, but the plan's mesh has no `ep` group"))
    }
}

/// How tokens are held to expert capacity in one pass.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Routing {
    /// Tokens of a capacity group; `None` routes dropless whatever the model's
    /// capacity factor (decoding: groups of one token would pad every expert).
    pub group_tokens: Option<usize>,
    /// Every member of the expert group pads the same number of rows, so the
    /// padded counts need no exchange (false when members hold different numbers
    /// of tokens).
    pub even: bool,
}

impl Routing {
    /// No capacity: every token reaches every expert it chose.
    pub(crate) const DROPLESS: Routing = Routing {
        group_tokens: None,
        even: false,
    };
}

/// Experts split over both tp and ep need sequence parallelism: otherwise every
/// tensor rank would hold, and route, the same tokens (the planner requires it,
/// `check_train_shapes`).
pub(crate) fn check_split(name: &str, tp: TpPos, ep: TpPos, sp: bool) -> Result<(), RankError> {
    if tp.size > 1 && ep.size > 1 && !sp {
        return Err(fail(format!(
            "{name}: experts with tp={} and ep={} need sp=true",
            tp.size, ep.size
        )));
    }
    Ok(())
}

/// Tokens of one capacity group: the run's override, or a rank's slice of a
/// sequence as the plan prices it.
pub(crate) fn group_tokens(
    over: Option<usize>,
    seq_len: usize,
    (cp, tp, ep): (usize, usize, usize),
) -> usize {
    over.unwrap_or_else(|| {
        meshplan_ir::graph::capacity_group_tokens(seq_len as u64, cp as u64, tp as u64, ep as u64)
            as usize
    })
}

/// (hidden, this rank's expert MLP width, experts, top-k): experts split over
/// `ep` hold whole MLPs, otherwise each MLP is split over `tp`.
pub(crate) fn dims(e: &ExpertsShape, tp: TpPos, ep: TpPos) -> (usize, usize, usize, usize) {
    let tp_split = if ep.size == 1 { tp.size } else { 1 };
    (
        e.hidden as usize,
        e.ffn as usize / tp_split,
        e.experts as usize,
        e.top_k as usize,
    )
}

/// An experts op's forward state, kept for its backward.
pub(crate) struct Kept<D: Device> {
    pub routed: Routed<D>,
    /// The rows this rank's experts processed (expert-major), their counts.
    pub local_rows: D::Act,
    pub local_counts: Vec<usize>,
    pub ups: D::Act,
    pub acts: D::Act,
    /// The experts' outputs back at this rank, in dispatch-slot order.
    pub y_disp: D::Act,
    pub route: Route,
    pub moves: Moves<D>,
    /// Dispatch slots routed, and of those dropped over capacity.
    pub slots: (u64, u64),
}

/// The row moves of one experts op as device index lists.
pub(crate) struct Moves<D: Device> {
    /// Under a capacity: slots into the padded buffer, and back.
    pad: Option<(D::Ids, D::Ids)>,
    /// Over ranks: source-major rows to expert-major, and back.
    order: Option<(D::Ids, D::Ids)>,
}

/// One rank running one experts op: its device, its communicator, where it sits.
pub(crate) struct Exec<'c, D: Device> {
    pub dev: &'c D,
    pub comm: &'c mut D::Comm,
    pub place: Place<'c>,
    /// The op, for errors.
    pub name: &'c str,
}

impl<'c, D: Device> Exec<'c, D> {
    /// Experts op `name` on `dev` and `comm`, at `(tp, ep)` in expert group `group`.
    pub(crate) fn new(
        (dev, comm): (&'c D, &'c mut D::Comm),
        (tp, ep): (TpPos, TpPos),
        group: Option<&'c Group>,
        name: &'c str,
    ) -> Self {
        let place = Place { tp, ep, group };
        Exec {
            dev,
            comm,
            place,
            name,
        }
    }

    fn zeros(&self, n: usize) -> Result<D::Act, RankError> {
        self.dev.act_zeros(n).map_err(derr(self.name))
    }

    fn ids_of(&self, host: &[u32]) -> Result<D::Ids, RankError> {
        self.dev.ids_upload(host).map_err(derr(self.name))
    }

    /// Rows of `src` in the order of `idx` (zeros for `NO_ROW`).
    fn gather(&self, src: &D::Act, idx: &D::Ids, h: usize) -> Result<D::Act, RankError> {
        let mut out = self.zeros(D::ids_len(idx) * h)?;
        self.dev
            .gather_rows(src, idx, h, &mut out)
            .map_err(derr(self.name))?;
        Ok(out)
    }

    /// Rows to the ranks holding their experts (`back`: from them), counts from
    /// `route`.
    fn exchange_rows(
        &mut self,
        rows: &D::Act,
        route: &Route,
        h: usize,
        back: bool,
    ) -> Result<D::Act, RankError> {
        let (sc, rc) = route.elements(h);
        let (sc, rc) = if back { (rc, sc) } else { (sc, rc) };
        let g = self.place.ep_group()?;
        let mut out = self.zeros(rc.iter().sum())?;
        self.comm
            .all_to_all_v_act(self.dev, (g, "ep"), (rows, &sc), (&mut out, &rc))?;
        Ok(out)
    }

    /// Rows in dispatch-slot order to the rows this rank's experts process
    /// (expert-major): padded to capacity, exchanged, regrouped by expert.
    pub fn send_to_experts(
        &mut self,
        slots: D::Act,
        route: &Route,
        moves: &Moves<D>,
        h: usize,
    ) -> Result<D::Act, RankError> {
        let sent = match &moves.pad {
            Some((to_pad, _)) => self.gather(&slots, to_pad, h)?,
            None => slots,
        };
        match &moves.order {
            Some((to_em, _)) => {
                let src_major = self.exchange_rows(&sent, route, h, false)?;
                self.gather(&src_major, to_em, h)
            }
            None => Ok(sent),
        }
    }

    /// The inverse of [`Exec::send_to_experts`]: expert-major rows back to their
    /// sources, in dispatch-slot order (zeros for dropped slots).
    pub fn bring_back(
        &mut self,
        rows: D::Act,
        route: &Route,
        moves: &Moves<D>,
        h: usize,
    ) -> Result<D::Act, RankError> {
        let back = match &moves.order {
            Some((_, to_sm)) => {
                let sm = self.gather(&rows, to_sm, h)?;
                self.exchange_rows(&sm, route, h, true)?
            }
            None => rows,
        };
        match &moves.pad {
            Some((_, from_pad)) => self.gather(&back, from_pad, h),
            None => Ok(back),
        }
    }

    /// Routes `x`'s tokens (`[rows, hidden]`, router scores `logits`) and runs
    /// them through their experts (this rank's stacked `weights`, up and down):
    /// the op's output `[rows, hidden]` (partial over `tp` when the experts split
    /// over it), and the state its backward needs. Zero rows is allowed: a rank
    /// with no tokens still serves its experts to the rest of its expert group.
    pub fn forward(
        &mut self,
        e: &ExpertsShape,
        (x, logits): (&D::Act, &D::Act),
        weights: (&D::Act, &D::Act),
        routing: Routing,
    ) -> Result<(D::Act, Kept<D>), RankError> {
        let err = derr(self.name);
        let (h, f, ne, kk) = dims(e, self.place.tp, self.place.ep);
        let rows = D::act_len(x) / h;
        // The routing kernels renormalise each token's top-k weights.
        let m = MoeDims {
            tokens: rows,
            experts: ne,
            k: kk,
            dim: h,
            renormalize: true,
        };
        // Under an expert capacity, each expert keeps the first `cap` slots of
        // every capacity group in token order, and the buffers are padded to it.
        let capacity = match routing.group_tokens.map(|g| (g, e.capacity(g as u64))) {
            Some((group, Some(cap))) if rows > 0 => {
                if group == 0 || !rows.is_multiple_of(group) {
                    return Err(fail(format!(
                        "experts: {rows} local tokens are not whole capacity groups of {group}"
                    )));
                }
                Some(Capacity {
                    group,
                    cap: cap as usize,
                })
            }
            _ => None,
        };
        let f32s = |n| self.dev.f32_zeros(n).map_err(&err);
        let mut r = Routed {
            m,
            capacity,
            probs: f32s(rows * ne)?,
            idx: self.dev.ids_zeros(rows * kk).map_err(&err)?,
            wts: f32s(rows * kk)?,
            perm: self.dev.ids_zeros(rows * kk).map_err(&err)?,
            counts: vec![0; ne],
            padded: None,
            kept: Vec::new(),
        };
        let mut disp = self.zeros(rows * kk * h)?;
        if rows > 0 {
            self.dev.moe_route(logits, &mut r).map_err(&err)?;
            self.dev.moe_dispatch(&mut r, x, &mut disp).map_err(&err)?;
        }
        let pad = r.padded.take().map(|[pad, at]| (pad, at));
        let (send_counts, even, dropped) = match capacity {
            Some(c) => {
                let dropped = rows * kk - r.kept.iter().sum::<usize>();
                (vec![c.per_expert(rows); ne], routing.even, dropped)
            }
            None => (r.counts.clone(), false, 0),
        };
        let route = route_of(self.comm, &self.place, &send_counts, ne, even)?;
        let order = if route.is_local() {
            None
        } else {
            let to_em = self.ids_of(&route.expert_major_index())?;
            Some((to_em, self.ids_of(&route.source_major_index())?))
        };
        let moves = Moves { pad, order };
        let local_rows = self.send_to_experts(disp, &route, &moves, h)?;
        let local_counts = route.local_counts();
        let (y, ups, acts) =
            local_mlp(self.dev, e, f, &local_rows, &local_counts, weights).map_err(&err)?;
        let y_disp = self.bring_back(y, &route, &moves, h)?;
        let mut out = self.zeros(rows * h)?;
        if rows > 0 {
            self.dev.moe_combine(&r, &y_disp, &mut out).map_err(&err)?;
        }
        let kept = Kept {
            routed: r,
            local_rows,
            local_counts,
            ups,
            acts,
            y_disp,
            route,
            moves,
            slots: ((rows * kk) as u64, dropped as u64),
        };
        Ok((out, kept))
    }
}

/// Each local expert's MLP (`f` wide) on its rows (expert-major, `counts` per
/// local expert), as spans of the stacked weights `[experts, h, up]` and
/// `[experts, f, h]`: (outputs, up projections, activations). Both interpreters
/// run it, on any device.
pub(crate) fn local_mlp<D: Device>(
    dev: &D,
    e: &ExpertsShape,
    f: usize,
    rows: &D::Act,
    counts: &[usize],
    (w_up, w_down): (&D::Act, &D::Act),
) -> DResult<(D::Act, D::Act, D::Act)> {
    let h = e.hidden as usize;
    let gated = e.mlp == meshplan_ir::MlpKind::Swiglu;
    let up_w = if gated { 2 * f } else { f };
    let total: usize = counts.iter().sum();
    let mut ups = dev.act_zeros(total * up_w)?;
    let mut acts = dev.act_zeros(total * f)?;
    let mut y = dev.act_zeros(total * h)?;
    linear_spans(dev, counts, (h, up_w), (rows, w_up), &mut ups)?;
    // Row by row: one call over every expert's rows.
    if gated {
        dev.swiglu_fwd(&ups, f, &mut acts)?;
    } else {
        dev.gelu_fwd(&ups, &mut acts)?;
    }
    linear_spans(dev, counts, (f, h), (&acts, w_down), &mut y)?;
    Ok((y, ups, acts))
}

/// (local expert, first row, rows) of each expert with rows.
pub(crate) fn spans(counts: &[usize]) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    counts
        .iter()
        .scan(0, |off, &n| {
            let at = *off;
            *off += n;
            Some((at, n))
        })
        .enumerate()
        .filter(|(_, (_, n))| *n > 0)
        .map(|(j, (off, n))| (j, off, n))
}

/// Each local expert's rows through its block of a stacked weight: for expert `j`
/// with `n` rows from row `off`, `y[off..][n, cols] = x[off..][n, k] w[j]` (`w` is
/// `[experts, k, cols]`).
pub(crate) fn linear_spans<D: Device>(
    dev: &D,
    counts: &[usize],
    (k, cols): (usize, usize),
    (x, w): (&D::Act, &D::Act),
    y: &mut D::Act,
) -> DResult<()> {
    for (j, off, n) in spans(counts) {
        let g = GemmAt {
            ta: Transpose::No,
            tb: Transpose::No,
            m: n,
            k,
            n: cols,
            a_off: off * k,
            b_off: j * k * cols,
            c_off: off * cols,
        };
        dev.matmul(g, x, w, y)?;
    }
    Ok(())
}

/// The exchange's counts: what this rank sends each member's experts (`counts`,
/// per global expert) and what it receives from each (exchanged first, unless
/// `even`: then every member sends every expert the same padded count).
pub(crate) fn route_of(
    comm: &mut (impl Communicator + ?Sized),
    place: &Place<'_>,
    counts: &[usize],
    ne: usize,
    even: bool,
) -> Result<Route, RankError> {
    let n = place.ep.size;
    let el = ne / n;
    if n == 1 {
        return Ok(Route {
            n: 1,
            el,
            send: vec![counts.to_vec()],
            recv: vec![counts.to_vec()],
        });
    }
    let g = place.ep_group()?;
    let recv_counts: Vec<f32> = if even {
        counts.iter().map(|&c| c as f32).collect()
    } else {
        let send_counts: Vec<f32> = counts.iter().map(|&c| c as f32).collect();
        let mut recv_counts = vec![0.0f32; el * n];
        comm.all_to_all(g, "ep", &send_counts, &mut recv_counts)?;
        recv_counts
    };
    let send: Vec<Vec<usize>> = (0..n)
        .map(|d| counts[d * el..(d + 1) * el].to_vec())
        .collect();
    let recv: Vec<Vec<usize>> = (0..n)
        .map(|s| {
            recv_counts[s * el..(s + 1) * el]
                .iter()
                .map(|&c| c as usize)
                .collect()
        })
        .collect();
    Ok(Route { n, el, send, recv })
}

/// Token counts of an expert-parallel exchange: `send[d][j]` rows for destination
/// `d`'s local expert `j`, `recv[s][j]` rows from source `s` for local expert `j`.
pub(crate) struct Route {
    n: usize,
    el: usize,
    send: Vec<Vec<usize>>,
    recv: Vec<Vec<usize>>,
}

impl Route {
    /// No exchange: this rank holds every expert.
    pub fn is_local(&self) -> bool {
        self.n == 1
    }

    /// Rows each local expert processes (from every source).
    pub fn local_counts(&self) -> Vec<usize> {
        (0..self.el)
            .map(|j| self.recv.iter().map(|r| r[j]).sum())
            .collect()
    }

    /// Elements sent to each member, and received from each, rows of `h`.
    pub fn elements(&self, h: usize) -> (Vec<usize>, Vec<usize>) {
        let of = |c: &[Vec<usize>]| c.iter().map(|c| c.iter().sum::<usize>() * h).collect();
        (of(&self.send), of(&self.recv))
    }

    /// For each expert-major row (per local expert, its rows from source 0, 1,
    /// ...), its row in the source-major order the exchange delivers (per source,
    /// its rows for local expert 0, 1, ...).
    pub fn expert_major_index(&self) -> Vec<u32> {
        let mut starts = vec![vec![0usize; self.el]; self.n];
        let mut off = 0;
        for (s, row) in starts.iter_mut().enumerate() {
            for (j, start) in row.iter_mut().enumerate() {
                *start = off;
                off += self.recv[s][j];
            }
        }
        let mut idx = Vec::with_capacity(off);
        for j in 0..self.el {
            for (s, row) in starts.iter().enumerate() {
                idx.extend((row[j]..row[j] + self.recv[s][j]).map(|r| r as u32));
            }
        }
        idx
    }

    /// The inverse of [`Route::expert_major_index`]: for each source-major row,
    /// its expert-major row.
    pub fn source_major_index(&self) -> Vec<u32> {
        let em = self.expert_major_index();
        let mut idx = vec![0u32; em.len()];
        for (e, &s) in em.iter().enumerate() {
            idx[s as usize] = e as u32;
        }
        idx
    }
}

#[cfg(test)]
mod tests {
    use super::Route;

    fn gather(src: &[f32], idx: &[u32], h: usize) -> Vec<f32> {
        let mut out = vec![0.0; idx.len() * h];
        meshplan_kernels::cpu::gather_rows(src, idx, h, &mut out).unwrap();
        out
    }

    #[test]
    fn route_reorders_rows_between_source_and_expert_major() {
        // Two sources, two local experts: source 0 sends 1 row for expert 0 and 2
        // for expert 1, source 1 sends 2 and 0. Delivered source-major rows
        // [s0e0, s0e1, s0e1, s1e0, s1e0] are expert-major [s0e0, s1e0, s1e0, s0e1,
        // s0e1], i.e. rows 0, 3, 4, 1, 2.
        let r = Route {
            n: 2,
            el: 2,
            send: vec![vec![0, 0], vec![0, 0]],
            recv: vec![vec![1, 2], vec![2, 0]],
        };
        assert_eq!(r.expert_major_index(), vec![0, 3, 4, 1, 2]);
        // Its inverse: source-major row s is expert-major row [0, 3, 4, 1, 2][s]
        // (this permutation is its own inverse).
        assert_eq!(r.source_major_index(), vec![0, 3, 4, 1, 2]);
        assert_eq!(r.local_counts(), vec![3, 2]);
        let rows: Vec<f32> = (0..5).map(|x| x as f32).collect();
        let em = gather(&rows, &r.expert_major_index(), 1);
        assert_eq!(em, vec![0.0, 3.0, 4.0, 1.0, 2.0]);
        assert_eq!(gather(&em, &r.source_major_index(), 1), rows);
        assert_eq!(r.elements(3), (vec![0, 0], vec![9, 6]));
    }
}
