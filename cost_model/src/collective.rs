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

use crate::cluster::{Cluster, GroupShape, Link};
use crate::overlay::{
    AlphaBeta, CollectiveFit, InterNodeFit, LinkOp, COLLECTIVE_SIZES_MAX, INTER_FITS_MAX,
};

/// The collectives the cost model prices: the plan's own kinds, one enum for the
/// plan, its prices and the overlays' measurements.
pub type Collective = meshplan_ir::plan::CollectiveKind;

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

/// Measured collectives across nodes (a calibration overlay's `inter_node`), in a
/// fixed-size table so that a pricing context stays `Copy`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MeasuredAcrossNodes {
    /// The fits as validated; `None` marks an unused slot.
    fits: [Option<InterNodeFit>; INTER_FITS_MAX],
}

impl MeasuredAcrossNodes {
    /// The table of `fits` (validated: at most [`INTER_FITS_MAX`]; later entries
    /// beyond that are ignored).
    pub fn new(fits: &[InterNodeFit]) -> MeasuredAcrossNodes {
        let mut t = MeasuredAcrossNodes {
            fits: [None; INTER_FITS_MAX],
        };
        for (slot, f) in t.fits.iter_mut().zip(fits) {
            *slot = Some(*f);
        }
        t
    }

    /// Seconds of `op` over a group spanning `nodes` nodes with `per_node` ranks on
    /// each, if the overlay measured `op` with `per_node` ranks per node on `nodes`
    /// or fewer nodes.
    ///
    /// # Assumptions
    /// Measured at exactly `nodes`: the fit, `alpha + bytes / beta`. Otherwise the
    /// fit of the largest measured node count `k_m` below `nodes` is stretched as a
    /// ring across `k = nodes` nodes would stretch it: its latency grows with the ring's
    /// node crossings, `alpha (k - 1) / (k_m - 1)` (the whole fitted latency, in-node hops
    /// included, is taken to scale so), and its bandwidth term with the share of the
    /// buffer each rank sends over the slowest hop (`volume`, below) at `k` against
    /// `k_m`: a rank's NIC share `beta` is taken to stay what it was measured at. No
    /// fit at or below `nodes` (or another `per_node`): `None`, the link model.
    pub fn time_s(&self, op: LinkOp, nodes: u64, per_node: u64, bytes: f64) -> Option<f64> {
        let mut below: Option<InterNodeFit> = None;
        for f in self.fits.iter().flatten() {
            if f.op != op || f.ranks_per_node != per_node || f.nodes > nodes {
                continue;
            }
            if f.nodes == nodes {
                return Some(f.fit.time_s(bytes));
            }
            if below.is_none_or(|b| f.nodes > b.nodes) {
                below = Some(*f);
            }
        }
        let m = below?;
        let crossings = (nodes - 1) as f64 / (m.nodes - 1) as f64;
        let volume = Self::volume(op, nodes, per_node) / Self::volume(op, m.nodes, per_node);
        Some(m.fit.alpha_s * crossings + bytes / m.fit.beta_bytes_per_s * volume)
    }

    /// The share of the message that one rank sends through its node's NICs, up to a
    /// constant: a ring's `(N - 1) / N` over `N = nodes x per_node` ranks for
    /// AllReduce, AllGather and ReduceScatter; the part of an All-to-All that leaves
    /// the node, `(nodes - 1) / nodes`; the whole buffer for Broadcast's chain and a
    /// send.
    fn volume(op: LinkOp, nodes: u64, per_node: u64) -> f64 {
        let n = (nodes * per_node) as f64;
        let k = nodes as f64;
        match op {
            LinkOp::AllReduce | LinkOp::AllGather | LinkOp::ReduceScatter => (n - 1.0) / n,
            LinkOp::AllToAll => (k - 1.0) / k,
            LinkOp::Broadcast | LinkOp::SendRecv => 1.0,
        }
    }

    /// Seconds of a send of `bytes` between two nodes: the measured `send_recv` with
    /// the most ranks per node sending at once (a pipeline boundary's sends run side
    /// by side, one per rank of the stage), if any.
    pub fn send_recv_s(&self, bytes: f64) -> Option<f64> {
        self.fits
            .iter()
            .flatten()
            .filter(|f| f.op == LinkOp::SendRecv)
            .max_by_key(|f| f.ranks_per_node)
            .map(|f| f.fit.time_s(bytes))
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
    /// Collectives measured across nodes (calibration overlay); they replace the
    /// hierarchical model for the group shapes they name or extrapolate to.
    pub measured_across: Option<MeasuredAcrossNodes>,
}

impl CommModel {
    /// Effective links of a cluster (calibrated fractions of the datasheet bandwidth),
    /// with the collectives its calibration overlay measured.
    pub fn new(cluster: &Cluster) -> CommModel {
        CommModel {
            intra: Link {
                bandwidth_bytes_per_s: cluster.intra.bandwidth_bytes_per_s
                    * cluster.constants.nvlink_efficiency,
                latency_s: cluster.intra.latency_s,
            },
            inter: Link {
                bandwidth_bytes_per_s: cluster.inter.bandwidth_bytes_per_s
                    * cluster.constants.ib_efficiency,
                latency_s: cluster.inter.latency_s,
            },
            measured: cluster
                .calibration
                .as_ref()
                .filter(|c| !c.intra_node.is_empty())
                .map(|c| MeasuredLinks::new(&c.intra_node)),
            measured_across: cluster
                .calibration
                .as_ref()
                .filter(|c| !c.inter_node.is_empty())
                .map(|c| MeasuredAcrossNodes::new(&c.inter_node)),
        }
    }

    /// Links exactly as given, for hand-worked tests.
    pub fn exact(intra: Link, inter: Link) -> CommModel {
        CommModel {
            intra,
            inter,
            measured: None,
            measured_across: None,
        }
    }

    /// The measured fit of `op` over `ranks` ranks inside a node, if any.
    #[inline]
    fn fit(&self, op: LinkOp, ranks: u64) -> Option<AlphaBeta> {
        self.measured.as_ref().and_then(|m| m.get(op, ranks))
    }

    /// The measured time of `op` over `nodes` nodes with `per_node` ranks on each, if
    /// the overlay has it or a smaller node count to extrapolate from.
    #[inline]
    fn across_nodes_s(&self, op: LinkOp, nodes: u64, per_node: u64, bytes: f64) -> Option<f64> {
        self.measured_across
            .as_ref()
            .and_then(|m| m.time_s(op, nodes, per_node, bytes))
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
    /// - A group spanning `k` nodes with `g` ranks per node runs as NCCL's rings over
    ///   rails do: a reduce-scatter inside each node, `g` concurrent inter-node
    ///   collectives over `k` ranks each on `1/g` of the data (each GPU using its own
    ///   share of the node's NICs), an all-gather inside the node. NCCL pipelines the
    ///   phases chunk by chunk, so the bandwidth time is the slower phase's, not their
    ///   sum; the latency is the ring's: every one of its `N - 1` steps (twice for
    ///   AllReduce) pays a hop's latency, the `k - 1` node crossings at the inter-node
    ///   latency (already in the inter-node phase) and the rest at the in-node one.
    ///   The phases inside the node use the measured ReduceScatter/AllGather/Broadcast
    ///   of `g` ranks where measured.
    /// - A collective the overlay measured across nodes (`inter_node`, `g` ranks per
    ///   node) takes that fit instead of all of the above (see
    ///   `MeasuredAcrossNodes::time_s` for node counts between measured ones).
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
        // NCCL's own algorithm across these nodes, as measured, over the model of it.
        if let Some(t) = self.across_nodes_s(LinkOp::of(kind), k, g, bytes) {
            return t;
        }
        let bi = self.intra.bandwidth_bytes_per_s;
        let (ae, be) = (self.inter.latency_s, self.inter.bandwidth_bytes_per_s);
        // Ring steps inside nodes beyond the in-node phase's own `g - 1`.
        let steps_in_nodes = n.saturating_sub(g + k - 1) as f64 * self.intra.latency_s;
        match kind {
            Collective::AllReduce => {
                let inner = self.inside_node_s(Collective::ReduceScatter, g, bytes)
                    + self.inside_node_s(Collective::AllGather, g, bytes);
                let chunk = bytes / g as f64;
                let ring = ring_all_reduce_s(k, ae, be, chunk);
                let tree = tree_all_reduce_s(k, ae, be, chunk);
                // A tree crosses nodes in log2(k) steps; only the ring pays them all.
                if ring <= tree {
                    inner.max(ring) + 2.0 * steps_in_nodes
                } else {
                    inner.max(tree)
                }
            }
            Collective::AllGather | Collective::ReduceScatter => {
                self.inside_node_s(kind, g, bytes).max(ring_all_gather_s(
                    k,
                    ae,
                    be,
                    bytes / g as f64,
                )) + steps_in_nodes
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
    /// overlay's measured `send_recv` inside or across nodes when it has one).
    pub fn p2p_time_s(&self, same_node: bool, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        if same_node {
            if let Some(f) = self.fit(LinkOp::SendRecv, 2) {
                return f.time_s(bytes);
            }
        } else if let Some(t) = self
            .measured_across
            .as_ref()
            .and_then(|m| m.send_recv_s(bytes))
        {
            return t;
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
    fn a_ring_across_many_nodes_pays_a_latency_per_step() {
        // 1536 ranks, 8 per node, 192 nodes; AllGather of 1 MB with 3 us in a node
        // and 8 us across: bandwidth is nothing here. The ring's 1535 steps: 191 node
        // crossings at 8 us (the inter-node phase) = 1.528 ms; the in-node phase's 7
        // steps at 3 us = 21 us... overlapped with the crossings (pipelined phases:
        // the larger, 1.528 ms + its bytes); the other 1535 - 7 - 191 = 1337 steps at
        // 3 us = 4.011 ms.
        let m = CommModel::exact(link(300.0, 3.0), link(25.0, 8.0));
        let g = GroupShape {
            size: 1536,
            per_node: 8,
        };
        let t = m.time_s(Collective::AllGather, g, 1e6);
        let outer = 191.0 * 8e-6 + 191.0 / 192.0 * (1e6 / 8.0) / 25e9;
        let want = outer + 1337.0 * 3e-6;
        assert!((t - want).abs() < 1e-12, "{t} vs {want}");
        assert!((t - 5.544e-3).abs() < 1e-5, "{t}");
    }

    #[test]
    fn hierarchical_all_reduce_across_nodes() {
        // 16 ranks, 8 per node, 2 nodes. Inside: 2 x ring AG over 8 on M =
        // 2 x 7/8 x 8 GB / 300 GB/s = 46.7 ms; outside: ring AR over 2 nodes on M/8
        // over IB = 1 GB / 25 GB/s = 40 ms. Pipelined: the slower, 46.7 ms (the sum,
        // 86.7 ms, over-prices it 1.86x).
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
        assert!((t - inside.max(outside)).abs() < 1e-12, "{t}");
        assert!((inside - 0.046_666_666_666_7).abs() < 1e-9 && (outside - 0.04).abs() < 1e-12);
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
        // Crossing nodes is never faster than staying inside one (here as fast: the
        // node's eight NICs carry their eighths faster than NVLink moves the rest).
        let inside_only = m.time_s(
            Collective::AllReduce,
            GroupShape {
                size: 8,
                per_node: 8,
            },
            bytes,
        );
        assert!(t >= inside_only);
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

    fn across(fits: &[(LinkOp, u64, u64, f64, f64)]) -> CommModel {
        let fits: Vec<InterNodeFit> = fits
            .iter()
            .map(
                |&(op, nodes, ranks_per_node, alpha_us, beta_gbps)| InterNodeFit {
                    op,
                    nodes,
                    ranks_per_node,
                    fit: AlphaBeta {
                        alpha_s: alpha_us * 1e-6,
                        beta_bytes_per_s: beta_gbps * 1e9,
                    },
                },
            )
            .collect();
        CommModel {
            measured_across: Some(MeasuredAcrossNodes::new(&fits)),
            ..CommModel::exact(link(300.0, 3.0), link(25.0, 8.0))
        }
    }

    #[track_caller]
    fn close(got: f64, want: f64) {
        assert!((got - want).abs() <= 1e-12 * want.abs(), "{got} vs {want}");
    }

    #[test]
    fn a_measured_shape_across_nodes_is_priced_as_its_fit() {
        // AllReduce over 2 nodes x 8 GPUs at 40 us + B / 50 GB/s: 1 GB takes
        // 40e-6 + 0.02 = 20.04 ms, whatever the links say.
        let m = across(&[(LinkOp::AllReduce, 2, 8, 40.0, 50.0)]);
        let g = GroupShape {
            size: 16,
            per_node: 8,
        };
        close(m.time_s(Collective::AllReduce, g, 1e9), 0.02004);
        // Another op or another shape keeps the link model.
        let plain = CommModel::exact(link(300.0, 3.0), link(25.0, 8.0));
        assert_eq!(
            m.time_s(Collective::AllGather, g, 1e9),
            plain.time_s(Collective::AllGather, g, 1e9)
        );
        let rails = GroupShape {
            size: 2,
            per_node: 1,
        };
        assert_eq!(
            m.time_s(Collective::AllReduce, rails, 1e9),
            plain.time_s(Collective::AllReduce, rails, 1e9)
        );
        // Inside one node the across-node fits do not apply.
        let inside = GroupShape {
            size: 8,
            per_node: 8,
        };
        assert_eq!(
            m.time_s(Collective::AllReduce, inside, 1e9),
            plain.time_s(Collective::AllReduce, inside, 1e9)
        );
    }

    #[test]
    fn more_nodes_stretch_the_largest_measured_count_below() {
        let m = across(&[
            (LinkOp::AllReduce, 2, 8, 40.0, 50.0),
            (LinkOp::AllReduce, 2, 1, 20.0, 25.0),
            (LinkOp::AllToAll, 2, 8, 30.0, 20.0),
            (LinkOp::Broadcast, 2, 8, 10.0, 40.0),
            (LinkOp::AllGather, 4, 8, 35.0, 60.0),
        ]);
        // 4 nodes x 8 from the 2-node fit: latency x (4-1)/(2-1) = 120 us; the ring's
        // share (31/32) / (15/16) = 1.0333...: 0.02 s x 1.0333 = 20.6667 ms; in all
        // 20.786667 ms.
        let t = m.time_s(
            Collective::AllReduce,
            GroupShape {
                size: 32,
                per_node: 8,
            },
            1e9,
        );
        close(t, 120e-6 + 0.02 * (31.0 / 32.0) / (15.0 / 16.0));
        assert!((t - 0.020_786_667).abs() < 1e-9, "{t}");
        // One rank per node on 8 nodes from 2: 7 x 20 us = 140 us; (7/8) / (1/2) =
        // 1.75 x 1e9 / 25e9 = 70 ms; 70.14 ms.
        let t = m.time_s(
            Collective::AllReduce,
            GroupShape {
                size: 8,
                per_node: 1,
            },
            1e9,
        );
        close(t, 0.07014);
        // All-to-All over 4 nodes x 8: the share leaving the node grows from 1/2 to
        // 3/4: 3 x 30 us + 1.5 x 1e9 / 20e9 = 90 us + 75 ms.
        let g48 = GroupShape {
            size: 32,
            per_node: 8,
        };
        close(m.time_s(Collective::AllToAll, g48, 1e9), 0.07509);
        // Broadcast's chain moves the whole buffer at any size: 3 x 10 us + 25 ms.
        close(m.time_s(Collective::Broadcast, g48, 1e9), 0.02503);
        // AllGather measured on 4 nodes: exact there (35 us + 1e9 / 60e9), from 4 on
        // 8 nodes (7/3 x 35 us; (63/64) / (31/32)), and nothing below 4: 2 nodes keep
        // the link model.
        close(
            m.time_s(Collective::AllGather, g48, 1e9),
            35e-6 + 1e9 / 60e9,
        );
        let g88 = GroupShape {
            size: 64,
            per_node: 8,
        };
        close(
            m.time_s(Collective::AllGather, g88, 1e9),
            35e-6 * 7.0 / 3.0 + 1e9 / 60e9 * (63.0 / 64.0) / (31.0 / 32.0),
        );
        let g28 = GroupShape {
            size: 16,
            per_node: 8,
        };
        let plain = CommModel::exact(link(300.0, 3.0), link(25.0, 8.0));
        assert_eq!(
            m.time_s(Collective::AllGather, g28, 1e9),
            plain.time_s(Collective::AllGather, g28, 1e9)
        );
    }

    #[test]
    fn the_nearest_count_below_wins() {
        // Measured on 2 and 8 nodes: 16 nodes stretch the 8-node fit (15/7 of 70 us),
        // 4 nodes the 2-node one (3 x 40 us).
        let m = across(&[
            (LinkOp::ReduceScatter, 2, 8, 40.0, 50.0),
            (LinkOp::ReduceScatter, 8, 8, 70.0, 45.0),
        ]);
        let shape = |nodes: u64| GroupShape {
            size: nodes * 8,
            per_node: 8,
        };
        close(
            m.time_s(Collective::ReduceScatter, shape(16), 1e9),
            70e-6 * 15.0 / 7.0 + 1e9 / 45e9 * (127.0 / 128.0) / (63.0 / 64.0),
        );
        close(
            m.time_s(Collective::ReduceScatter, shape(4), 1e9),
            120e-6 + 1e9 / 50e9 * (31.0 / 32.0) / (15.0 / 16.0),
        );
    }

    #[test]
    fn sends_between_nodes_take_the_measured_send_recv() {
        // Measured alone (1 per node) at 10 us + B / 45 GB/s and all 8 at once at
        // 12 us + B / 40 GB/s: a pipeline send takes the concurrent one, 12 us +
        // 1e8 / 40e9 = 2.512 ms; a send inside the node keeps NVLink.
        let m = across(&[
            (LinkOp::SendRecv, 2, 1, 10.0, 45.0),
            (LinkOp::SendRecv, 2, 8, 12.0, 40.0),
        ]);
        close(m.p2p_time_s(false, 1e8), 2.512e-3);
        close(m.p2p_time_s(true, 1e8), 3e-6 + 1e8 / 300e9);
        // Without a measured send the link model stays: 8 us + 1e8 / 25e9.
        let a = across(&[(LinkOp::AllReduce, 2, 8, 40.0, 50.0)]);
        close(a.p2p_time_s(false, 1e8), 8e-6 + 4e-3);
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
