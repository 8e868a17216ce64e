//! Redistribution: the one collective that moves a tensor from the placement its
//! producer leaves it in to the placement its consumer needs, with its alpha-beta cost.
//!
//! On one axis:
//!
//! | source \ target | `Shard(j)` | `Replicate` | `Partial` |
//! |---|---|---|---|
//! | `Shard(i)` | free if `i == j`, else All-to-All | AllGather | infeasible |
//! | `Replicate` | free (local slice) | free | infeasible |
//! | `Partial` | ReduceScatter | AllReduce | free |
//!
//! `Replicate -> Partial` could be made free (one rank keeps the value, the others
//! zeros), but no strategy of this planner consumes a partial input other than an
//! addition of two partial tensors, for which a zero-padded copy would only hide a
//! choice the producer could make itself; so it is infeasible, as is
//! `Shard -> Partial`.
//!
//! Sizes follow [`CommModel`]'s convention (nccl-tests): AllReduce, AllGather and
//! ReduceScatter are priced on the full buffer of the axis's group, All-to-All on one
//! rank's send buffer. On a multi-axis mesh a tensor is moved axis by axis; the buffer
//! an axis sees is the global size divided by the other axes on which the tensor is
//! sharded before or after the move (slices first, gathers last, the cheap order).

use crate::mesh::{Mesh, MeshAxis};
use crate::placement::Placement;
use meshplan_cost_model::collective::bytes_sent_per_rank;
use meshplan_cost_model::{Collective, CommModel};
use std::fmt;

/// What one axis of a redistribution needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AxisMove {
    /// Nothing, or a local slice.
    Free,
    /// One collective.
    Collective(Collective),
    /// No single step does it.
    Infeasible,
}

/// The move from `src` to `dst` on one axis (the table in the module doc).
pub fn axis_move(src: Placement, dst: Placement) -> AxisMove {
    use Placement::*;
    match (src, dst) {
        (a, b) if a == b => AxisMove::Free,
        (Replicate, Shard(_)) => AxisMove::Free,
        (Partial, Replicate) => AxisMove::Collective(Collective::AllReduce),
        (Partial, Shard(_)) => AxisMove::Collective(Collective::ReduceScatter),
        (Shard(_), Replicate) => AxisMove::Collective(Collective::AllGather),
        (Shard(_), Shard(_)) => AxisMove::Collective(Collective::AllToAll),
        (Shard(_), Partial) | (Replicate, Partial) => AxisMove::Infeasible,
        _ => AxisMove::Infeasible,
    }
}

/// A redistribution that no single collective per axis performs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Infeasible {
    /// The axis.
    pub axis: usize,
    /// Source placement on it.
    pub src: Placement,
    /// Target placement on it.
    pub dst: Placement,
}

impl fmt::Display for Infeasible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no single collective moves {} to {} on axis {}",
            self.src, self.dst, self.axis
        )
    }
}

impl std::error::Error for Infeasible {}

/// One collective of a redistribution.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    /// Mesh axis index.
    pub axis: usize,
    /// The collective.
    pub kind: Collective,
    /// Message size in [`CommModel`]'s convention (full buffer; one rank's send buffer
    /// for All-to-All).
    pub bytes: f64,
    /// Alpha-beta time.
    pub time_s: f64,
    /// Bytes one rank sends.
    pub sent_bytes: f64,
}

/// The step on one axis for a tensor whose buffer on this axis (the size the axis's
/// group sees, unsharded along this axis) is `axis_bytes`. `Ok(None)` when free.
pub fn one_axis(
    src: Placement,
    dst: Placement,
    axis_index: usize,
    axis: &MeshAxis,
    comm: &CommModel,
    axis_bytes: f64,
) -> Result<Option<Step>, Infeasible> {
    let kind = match axis_move(src, dst) {
        AxisMove::Free => return Ok(None),
        AxisMove::Infeasible => {
            return Err(Infeasible {
                axis: axis_index,
                src,
                dst,
            })
        }
        AxisMove::Collective(k) => k,
    };
    if axis.size <= 1 {
        return Ok(None);
    }
    let bytes = match kind {
        Collective::AllToAll => axis_bytes / axis.size as f64,
        _ => axis_bytes,
    };
    Ok(Some(Step {
        axis: axis_index,
        kind,
        bytes,
        time_s: comm.time_s(kind, axis.group, bytes),
        sent_bytes: bytes_sent_per_rank(kind, axis.size, bytes),
    }))
}

/// The steps, axis by axis, that move a tensor of `global_bytes` (its unsharded size)
/// from `src` to `dst` (one placement per mesh axis).
pub fn redistribute(
    src: &[Placement],
    dst: &[Placement],
    mesh: &Mesh,
    comm: &CommModel,
    global_bytes: f64,
) -> Result<Vec<Step>, Infeasible> {
    let mut steps = Vec::new();
    for (i, axis) in mesh.axes.iter().enumerate() {
        let (s, d) = (
            src.get(i).copied().unwrap_or(Placement::Replicate),
            dst.get(i).copied().unwrap_or(Placement::Replicate),
        );
        let mut buf = global_bytes;
        for (j, other) in mesh.axes.iter().enumerate() {
            if j == i {
                continue;
            }
            let sj = src.get(j).copied().unwrap_or(Placement::Replicate);
            let dj = dst.get(j).copied().unwrap_or(Placement::Replicate);
            if sj.is_shard() || dj.is_shard() {
                buf /= other.size.max(1) as f64;
            }
        }
        if let Some(step) = one_axis(s, d, i, axis, comm, buf)? {
            steps.push(step);
        }
    }
    Ok(steps)
}

/// Total time of a redistribution.
pub fn time_s(steps: &[Step]) -> f64 {
    steps.iter().map(|s| s.time_s).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshplan_cost_model::cluster::Link;
    use Placement::*;

    fn comm() -> CommModel {
        // 100 GB/s, 5 us inside a node; 10 GB/s, 10 us across.
        CommModel::exact(
            Link {
                bandwidth_bytes_per_s: 100e9,
                latency_s: 5e-6,
            },
            Link {
                bandwidth_bytes_per_s: 10e9,
                latency_s: 10e-6,
            },
        )
    }

    #[test]
    fn table_on_one_axis() {
        let all = [Shard(0), Shard(1), Replicate, Partial];
        for s in all {
            for d in all {
                let expect = match (s, d) {
                    _ if s == d => AxisMove::Free,
                    (Replicate, Shard(_)) => AxisMove::Free,
                    (Partial, Replicate) => AxisMove::Collective(Collective::AllReduce),
                    (Partial, Shard(_)) => AxisMove::Collective(Collective::ReduceScatter),
                    (Shard(_), Replicate) => AxisMove::Collective(Collective::AllGather),
                    (Shard(_), Shard(_)) => AxisMove::Collective(Collective::AllToAll),
                    (_, Partial) => AxisMove::Infeasible,
                    _ => unreachable!("every pair is listed"),
                };
                assert_eq!(axis_move(s, d), expect, "{s} -> {d}");
            }
        }
    }

    #[test]
    fn hand_worked_times_on_eight_ranks() {
        // 8 ranks in one node, B = 1 GB, alpha 5 us, bw 100 GB/s.
        let mesh = Mesh::one_d("tp", 8, 8);
        let c = comm();
        let b = 1e9;
        let one = |s, d| redistribute(&[s], &[d], &mesh, &c, b);
        // AllReduce: ring 2(n-1)/n B/bw + 2(n-1) alpha = 1.75e9/1e11 + 14*5e-6 = 0.01757.
        let ar = one(Partial, Replicate).unwrap();
        assert_eq!(ar.len(), 1);
        assert_eq!(ar[0].kind, Collective::AllReduce);
        assert!((ar[0].time_s - 0.01757).abs() < 1e-12, "{}", ar[0].time_s);
        assert!((ar[0].sent_bytes - 1.75e9).abs() < 1e-3);
        // AllGather and ReduceScatter: (n-1)/n B/bw + (n-1) alpha = 0.00875 + 3.5e-5.
        for (s, d, k) in [
            (Shard(0), Replicate, Collective::AllGather),
            (Partial, Shard(1), Collective::ReduceScatter),
        ] {
            let st = one(s, d).unwrap();
            assert_eq!(st[0].kind, k);
            assert!((st[0].time_s - 0.008785).abs() < 1e-12, "{}", st[0].time_s);
            assert!((st[0].sent_bytes - 0.875e9).abs() < 1e-3);
        }
        // All-to-All of one rank's B/8 send buffer: 7/8 * 0.125 GB / bw + 7 alpha.
        let a2a = one(Shard(0), Shard(2)).unwrap();
        assert_eq!(a2a[0].kind, Collective::AllToAll);
        assert!((a2a[0].bytes - 0.125e9).abs() < 1e-3);
        let expect = 7.0 / 8.0 * 0.125e9 / 100e9 + 7.0 * 5e-6;
        assert!((a2a[0].time_s - expect).abs() < 1e-12);
        // Free moves and infeasible ones.
        assert!(one(Replicate, Shard(1)).unwrap().is_empty());
        assert!(one(Shard(1), Shard(1)).unwrap().is_empty());
        assert!(one(Partial, Partial).unwrap().is_empty());
        assert!(one(Replicate, Partial).is_err());
        let e = one(Shard(0), Partial).unwrap_err();
        assert!(e.to_string().contains("S(0) to P"), "{e}");
    }

    #[test]
    fn two_axes_sum_axis_by_axis() {
        // dp=2 (across nodes) x tp=4 (inside): [S(0), P] -> [S(0), R] is an AllReduce
        // over tp of B/2 (the dp shard), nothing on dp.
        let mesh = Mesh::two_d(("dp", 2), ("tp", 4), 4);
        let c = comm();
        let b = 8e8;
        let st = redistribute(&[Shard(0), Partial], &[Shard(0), Replicate], &mesh, &c, b).unwrap();
        assert_eq!(st.len(), 1);
        assert_eq!(st[0].axis, 1);
        assert!((st[0].bytes - 4e8).abs() < 1e-3);
        // 2*3/4 * 4e8 / 1e11 + 6 * 5e-6
        assert!((st[0].time_s - (6e-3 + 3e-5)).abs() < 1e-12);
        // [P, S(1)] -> [R, R]: AllReduce over dp (one rank per node, IB) of B/4
        // (tp-sharded before), AllGather over tp of B.
        let st = redistribute(&[Partial, Shard(1)], &[Replicate, Replicate], &mesh, &c, b).unwrap();
        assert_eq!(st.len(), 2);
        assert_eq!(st[0].kind, Collective::AllReduce);
        assert!((st[0].bytes - 2e8).abs() < 1e-3);
        // Two ranks over IB: ring 2*1/2*2e8/1e10 + 2*10us = 0.02002 (tree is slower).
        assert!((st[0].time_s - 0.02002).abs() < 1e-12, "{}", st[0].time_s);
        assert_eq!(st[1].kind, Collective::AllGather);
        assert!((st[1].bytes - 8e8).abs() < 1e-3);
        assert!((time_s(&st) - (0.02002 + 0.75 * 8e8 / 1e11 + 15e-6)).abs() < 1e-12);
    }
}
