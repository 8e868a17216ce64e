//! Alpha-beta communication costs.
//!
//! Two layers: pure algorithm formulas over one homogeneous link (`ring_*`, `tree_*`,
//! with latency `alpha` seconds and bandwidth `bw` bytes/s), and [`CommModel`], which
//! places a group on the cluster ([`GroupShape`]) and prices it over NVLink inside a
//! node and hierarchically over InfiniBand across nodes.
//!
//! Message sizes follow nccl-tests: `bytes` is the full buffer of AllReduce and
//! Broadcast, the full gathered buffer of AllGather/ReduceScatter, and the whole send
//! buffer of one rank for All-to-All.

use crate::calib;
use crate::cluster::{Cluster, GroupShape, Link};
use crate::overlay::{AlphaBeta, CollectiveFit, LinkOp, COLLECTIVE_SIZES_MAX};
use serde::{Deserialize, Serialize};

/// The collectives the cost model prices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    /// Sum over the group, result everywhere.
    AllReduce,
    /// Concatenate shards, result everywhere.
    AllGather,
    /// Sum, each rank keeps one shard.
    ReduceScatter,
    /// One rank's buffer to all.
    Broadcast,
    /// Every rank sends a distinct shard to every other.
    AllToAll,
}

/// Ring AllReduce: reduce-scatter then all-gather, `2(N-1)` steps of `M/N` bytes.
///
/// # Assumptions
/// One homogeneous ring, full-duplex links, reduction compute free (hidden by copies).
pub fn ring_all_reduce_s(n: u64, alpha_s: f64, bw_bytes_per_s: f64, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n = n as f64;
    2.0 * (n - 1.0) * alpha_s + 2.0 * (n - 1.0) / n * bytes / bw_bytes_per_s
}

/// Ring AllGather or ReduceScatter of a full buffer of `bytes`: `N-1` steps of `M/N`.
///
/// # Assumptions
/// As [`ring_all_reduce_s`].
pub fn ring_all_gather_s(n: u64, alpha_s: f64, bw_bytes_per_s: f64, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n = n as f64;
    (n - 1.0) * alpha_s + (n - 1.0) / n * bytes / bw_bytes_per_s
}

/// Tree AllReduce (NCCL's double binary tree): a reduce up and a broadcast down,
/// pipelined, `2 log2(N)` latency steps.
///
/// # Assumptions
/// Each phase moves the whole buffer through a node's links, and a tree keeps its links
/// busy less evenly than a ring: the bandwidth term is
/// `calib::TREE_BANDWIDTH_FACTOR x 2 M / bw`, so trees win on small messages (latency)
/// and rings on large ones (bandwidth), as NCCL's tuner finds.
pub fn tree_all_reduce_s(n: u64, alpha_s: f64, bw_bytes_per_s: f64, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let depth = (n as f64).log2().ceil();
    2.0 * depth * alpha_s + crate::calib::TREE_BANDWIDTH_FACTOR * 2.0 * bytes / bw_bytes_per_s
}

/// Pairwise All-to-All: `N-1` exchanges, `(N-1)/N` of the send buffer leaves the rank.
pub fn all_to_all_s(n: u64, alpha_s: f64, bw_bytes_per_s: f64, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n = n as f64;
    (n - 1.0) * alpha_s + (n - 1.0) / n * bytes / bw_bytes_per_s
}

/// Broadcast: the cheaper of a pipelined chain (`(N-1) alpha + M/bw`) and a binary
/// tree (`log2(N) (alpha + M/bw)`).
pub fn broadcast_s(n: u64, alpha_s: f64, bw_bytes_per_s: f64, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let chain = (n as f64 - 1.0) * alpha_s + bytes / bw_bytes_per_s;
    let tree = (n as f64).log2().ceil() * (alpha_s + bytes / bw_bytes_per_s);
    chain.min(tree)
}

/// Point to point: `alpha + M/bw`.
pub fn p2p_s(alpha_s: f64, bw_bytes_per_s: f64, bytes: f64) -> f64 {
    alpha_s + bytes / bw_bytes_per_s
}

/// Measured collectives inside a node (a calibration overlay's `intra_node`), in a
/// fixed-size table so that a pricing context stays `Copy`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MeasuredLinks {
    /// Group sizes with a measurement; 0 marks an unused slot.
    sizes: [u64; COLLECTIVE_SIZES_MAX],
    /// `fits[op][slot]`: the fit of `LinkOp::ALL[op]` over `sizes[slot]` ranks.
    fits: [[Option<AlphaBeta>; COLLECTIVE_SIZES_MAX]; LinkOp::ALL.len()],
}

impl MeasuredLinks {
    /// The table of `fits` (validated: at most [`COLLECTIVE_SIZES_MAX`] distinct
    /// sizes; later entries beyond that are ignored).
    pub fn new(fits: &[CollectiveFit]) -> MeasuredLinks {
        let mut t = MeasuredLinks {
            sizes: [0; COLLECTIVE_SIZES_MAX],
            fits: [[None; COLLECTIVE_SIZES_MAX]; LinkOp::ALL.len()],
        };
        for f in fits {
            let slot = match t.sizes.iter().position(|&s| s == f.ranks) {
                Some(i) => i,
                None => match t.sizes.iter().position(|&s| s == 0) {
                    Some(i) => {
                        t.sizes[i] = f.ranks;
                        i
                    }
                    None => continue,
                },
            };
            t.fits[f.op.index()][slot] = Some(f.fit);
        }
        t
    }

    /// The fit of `op` over exactly `ranks` ranks, if measured.
    #[inline]
    pub fn get(&self, op: LinkOp, ranks: u64) -> Option<AlphaBeta> {
        let slot = self.sizes.iter().position(|&s| s == ranks)?;
        self.fits[op.index()][slot]
    }
}

/// Links as NCCL achieves them on a cluster.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CommModel {
    /// Inside a node, with NCCL's achieved fraction applied.
    pub intra: Link,
    /// Across nodes, per GPU, with NCCL's achieved fraction applied.
    pub inter: Link,
    /// Collectives measured inside a node (calibration overlay); they replace the
    /// link model for the group sizes they name.
    pub measured: Option<MeasuredLinks>,
}

impl CommModel {
    /// Effective links of a cluster (calibrated fractions of the datasheet bandwidth),
    /// with the collectives its calibration overlay measured.
    pub fn new(cluster: &Cluster) -> CommModel {
        CommModel {
            intra: Link {
                bandwidth_bytes_per_s: cluster.intra.bandwidth_bytes_per_s
                    * calib::NVLINK_EFFICIENCY,
                latency_s: cluster.intra.latency_s,
            },
            inter: Link {
                bandwidth_bytes_per_s: cluster.inter.bandwidth_bytes_per_s * calib::IB_EFFICIENCY,
                latency_s: cluster.inter.latency_s,
            },
            measured: cluster
                .calibration
                .as_ref()
                .filter(|c| !c.intra_node.is_empty())
                .map(|c| MeasuredLinks::new(&c.intra_node)),
        }
    }

    /// Links exactly as given, for hand-worked tests.
    pub fn exact(intra: Link, inter: Link) -> CommModel {
        CommModel {
            intra,
            inter,
            measured: None,
        }
    }

    /// The measured fit of `op` over `ranks` ranks inside a node, if any.
    #[inline]
    fn fit(&self, op: LinkOp, ranks: u64) -> Option<AlphaBeta> {
        self.measured.as_ref().and_then(|m| m.get(op, ranks))
    }

    /// One collective over `n` ranks inside one node: measured if the overlay has it,
    /// else the link model (AllReduce the cheaper of ring and tree).
    fn inside_node_s(&self, kind: Collective, n: u64, bytes: f64) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        if let Some(f) = self.fit(LinkOp::of(kind), n) {
            return f.time_s(bytes);
        }
        let (ai, bi) = (self.intra.latency_s, self.intra.bandwidth_bytes_per_s);
        match kind {
            Collective::AllReduce => {
                ring_all_reduce_s(n, ai, bi, bytes).min(tree_all_reduce_s(n, ai, bi, bytes))
            }
            Collective::AllGather | Collective::ReduceScatter => {
                ring_all_gather_s(n, ai, bi, bytes)
            }
            Collective::Broadcast => broadcast_s(n, ai, bi, bytes),
            Collective::AllToAll => all_to_all_s(n, ai, bi, bytes),
        }
    }

    /// Time of one collective over `group`.
    ///
    /// # Assumptions
    /// - Inside one node every GPU pair is connected through NVSwitch at `intra`
    ///   bandwidth; AllReduce takes the cheaper of ring and tree, as NCCL does. A
    ///   collective the calibration overlay measured for this group size takes its
    ///   fitted `alpha + bytes / beta` instead (NCCL's own choice, as measured).
    /// - A group spanning `k` nodes with `g` ranks per node runs hierarchically (as
    ///   NCCL's ring over rails does): a reduce-scatter inside each node, then `g`
    ///   concurrent inter-node collectives over `k` ranks each on `1/g` of the data,
    ///   each GPU using its own share of the node's NICs, then an all-gather inside the
    ///   node. The slowest link (InfiniBand) dominates. The phases inside the node use
    ///   the measured ReduceScatter/AllGather/Broadcast of `g` ranks where measured.
    /// - All-to-All across nodes sends `(g-1)/N` of its buffer over NVLink and
    ///   `(N-g)/N` over InfiniBand concurrently.
    pub fn time_s(&self, kind: Collective, group: GroupShape, bytes: f64) -> f64 {
        let n = group.size;
        if n <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        let g = group.per_node.max(1);
        let k = group.nodes();
        if k <= 1 {
            return self.inside_node_s(kind, n, bytes);
        }
        let bi = self.intra.bandwidth_bytes_per_s;
        let (ae, be) = (self.inter.latency_s, self.inter.bandwidth_bytes_per_s);
        match kind {
            Collective::AllReduce => {
                let inner = self.inside_node_s(Collective::ReduceScatter, g, bytes)
                    + self.inside_node_s(Collective::AllGather, g, bytes);
                let chunk = bytes / g as f64;
                let outer =
                    ring_all_reduce_s(k, ae, be, chunk).min(tree_all_reduce_s(k, ae, be, chunk));
                inner + outer
            }
            Collective::AllGather | Collective::ReduceScatter => {
                self.inside_node_s(kind, g, bytes) + ring_all_gather_s(k, ae, be, bytes / g as f64)
            }
            Collective::Broadcast => {
                broadcast_s(k, ae, be, bytes) + self.inside_node_s(Collective::Broadcast, g, bytes)
            }
            Collective::AllToAll => {
                let nf = n as f64;
                let intra_s = (g as f64 - 1.0) / nf * bytes / bi;
                let inter_s = (nf - g as f64) / nf * bytes / be;
                (nf - 1.0) * ae + intra_s.max(inter_s)
            }
        }
    }

    /// Point-to-point transfer between two ranks, over NVLink if `same_node` (the
    /// overlay's measured `send_recv` when it has one).
    pub fn p2p_time_s(&self, same_node: bool, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        if same_node {
            if let Some(f) = self.fit(LinkOp::SendRecv, 2) {
                return f.time_s(bytes);
            }
        }
        let l = if same_node { self.intra } else { self.inter };
        p2p_s(l.latency_s, l.bandwidth_bytes_per_s, bytes)
    }
}

/// Bytes one rank sends in a collective (the volume counted by `comm_bytes_per_gpu`).
///
/// Ring AllReduce sends `2(N-1)/N M`, AllGather/ReduceScatter and All-to-All
/// `(N-1)/N M`, Broadcast at most `M`.
pub fn bytes_sent_per_rank(kind: Collective, n: u64, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let f = (n as f64 - 1.0) / n as f64;
    match kind {
        Collective::AllReduce => 2.0 * f * bytes,
        Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => f * bytes,
        Collective::Broadcast => bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(bw_gbps: f64, lat_us: f64) -> Link {
        Link {
            bandwidth_bytes_per_s: bw_gbps * 1e9,
            latency_s: lat_us * 1e-6,
        }
    }

    #[test]
    fn ring_all_reduce_matches_closed_form() {
        // 2(N-1) alpha + 2(N-1)/N M/BW with N=8, alpha=5us, M=1 GB, BW=100 GB/s:
        // 14 * 5e-6 + 1.75 * 0.01 = 7e-5 + 0.0175 = 0.01757.
        let t = ring_all_reduce_s(8, 5e-6, 100e9, 1e9);
        assert!((t - 0.01757).abs() < 1e-12, "{t}");
    }

    #[test]
    fn four_rank_examples() {
        // N=4, alpha=10us, BW=50 GB/s, M=400 MB.
        // AllReduce: 6 alpha + 1.5 M/BW = 6e-5 + 1.5 * 8e-3 = 0.01206.
        // AllGather: 3 alpha + 0.75 M/BW = 3e-5 + 0.006 = 0.00603.
        assert!((ring_all_reduce_s(4, 10e-6, 50e9, 400e6) - 0.01206).abs() < 1e-12);
        assert!((ring_all_gather_s(4, 10e-6, 50e9, 400e6) - 0.00603).abs() < 1e-12);
        // Each rank sends 1.5 M for AllReduce and 0.75 M for AllGather.
        assert_eq!(bytes_sent_per_rank(Collective::AllReduce, 4, 400e6), 600e6);
        assert_eq!(bytes_sent_per_rank(Collective::AllGather, 4, 400e6), 300e6);
    }

    #[test]
    fn tree_wins_small_ring_wins_large() {
        let m = CommModel::exact(link(300.0, 10.0), link(25.0, 10.0));
        let g = GroupShape {
            size: 64,
            per_node: 64,
        };
        let small = 1e3;
        let big = 1e9;
        let ring_small = ring_all_reduce_s(64, 10e-6, 300e9, small);
        let ring_big = ring_all_reduce_s(64, 10e-6, 300e9, big);
        assert!(m.time_s(Collective::AllReduce, g, small) < ring_small);
        assert_eq!(m.time_s(Collective::AllReduce, g, big), ring_big);
    }

    #[test]
    fn hierarchical_all_reduce_across_nodes() {
        // 16 ranks, 8 per node, 2 nodes. Inside: 2 x ring AG over 8 on M;
        // outside: ring AR over 2 nodes on M/8 over IB.
        let m = CommModel::exact(link(300.0, 0.0), link(25.0, 0.0));
        let bytes = 8e9;
        let t = m.time_s(
            Collective::AllReduce,
            GroupShape {
                size: 16,
                per_node: 8,
            },
            bytes,
        );
        let inside = 2.0 * 7.0 / 8.0 * bytes / 300e9;
        let outside = 2.0 * 1.0 / 2.0 * 1e9 / 25e9;
        assert!((t - (inside + outside)).abs() < 1e-12, "{t}");
        // One rank per node: the whole buffer crosses IB.
        let t1 = m.time_s(
            Collective::AllReduce,
            GroupShape {
                size: 2,
                per_node: 1,
            },
            bytes,
        );
        assert!((t1 - bytes / 25e9).abs() < 1e-12);
        // Crossing nodes is slower than staying inside one.
        let inside_only = m.time_s(
            Collective::AllReduce,
            GroupShape {
                size: 8,
                per_node: 8,
            },
            bytes,
        );
        assert!(t > inside_only);
    }

    #[test]
    fn group_shapes_on_dgx() {
        // tp=8 innermost on 8-GPU nodes: all in one node.
        assert_eq!(
            GroupShape::of_axis(8, 1, 8),
            GroupShape {
                size: 8,
                per_node: 8
            }
        );
        // dp=60 with stride 64 (tp*pp inner... here tp=8 inner): one rank per node.
        assert_eq!(
            GroupShape::of_axis(60, 8, 8),
            GroupShape {
                size: 60,
                per_node: 1
            }
        );
        // dp=32 with tp=2: 4 ranks per node, 8 nodes.
        let g = GroupShape::of_axis(32, 2, 8);
        assert_eq!(
            g,
            GroupShape {
                size: 32,
                per_node: 4
            }
        );
        assert_eq!(g.nodes(), 8);
    }

    #[test]
    fn all_to_all_inside_and_across() {
        let m = CommModel::exact(link(100.0, 0.0), link(10.0, 0.0));
        let inside = m.time_s(
            Collective::AllToAll,
            GroupShape {
                size: 4,
                per_node: 4,
            },
            4e9,
        );
        assert!((inside - 0.75 * 4e9 / 100e9).abs() < 1e-12);
        let across = m.time_s(
            Collective::AllToAll,
            GroupShape {
                size: 16,
                per_node: 8,
            },
            16e9,
        );
        assert!((across - 8.0 / 16.0 * 16e9 / 10e9).abs() < 1e-12);
    }

    #[test]
    fn broadcast_and_p2p() {
        assert!((broadcast_s(2, 1e-6, 1e9, 1e9) - (1e-6 + 1.0)).abs() < 1e-12);
        assert!((p2p_s(2e-6, 10e9, 1e9) - (2e-6 + 0.1)).abs() < 1e-12);
        let m = CommModel::exact(link(100.0, 1.0), link(10.0, 5.0));
        assert!(m.p2p_time_s(false, 1e9) > m.p2p_time_s(true, 1e9));
        assert_eq!(
            m.time_s(
                Collective::AllReduce,
                GroupShape {
                    size: 1,
                    per_node: 1
                },
                1e9
            ),
            0.0
        );
    }
}
