//! The device mesh on the physical cluster: which mesh axes stay inside a node (NVLink)
//! and which cross nodes (InfiniBand), every node coloured by its pipeline stage, and
//! the first node drawn GPU by GPU with its groups. Nodes are drawn, not ranks, so a
//! 3840-GPU mesh stays a small, readable picture.

use crate::canvas::{text_width, Anchor, Canvas, Rgb};
use meshplan_cost_model::GroupShape;

/// The mesh and the cluster it is laid on.
#[derive(Clone, Debug, PartialEq)]
pub struct MeshDesc {
    /// Axis names, outermost first (rank order is row-major over `shape`).
    pub axes: Vec<String>,
    /// Size of each axis.
    pub shape: Vec<u64>,
    /// GPUs in one node (rank `r` is on node `r / gpus_per_node`).
    pub gpus_per_node: u64,
    /// Nodes.
    pub nodes: u64,
    /// Heading.
    pub title: String,
}

/// The link a mesh axis's groups communicate over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// Every group sits inside one node.
    NvLink,
    /// Groups span nodes.
    InfiniBand,
    /// The axis has size 1: no communication.
    Unused,
}

/// Where one axis sits.
#[derive(Clone, Debug, PartialEq)]
pub struct AxisLink {
    /// Axis name.
    pub axis: String,
    /// Ranks in a group.
    pub size: u64,
    /// Rank distance between consecutive members (product of the inner axes).
    pub stride: u64,
    /// Members of a group in one node.
    pub per_node: u64,
    /// Nodes a group spans.
    pub nodes: u64,
    /// The link.
    pub link: LinkKind,
}

/// How each axis of the mesh lies on the nodes (the cost model's [`GroupShape`]).
pub fn axis_links(axes: &[String], shape: &[u64], gpus_per_node: u64) -> Vec<AxisLink> {
    (0..axes.len())
        .map(|i| {
            let size = shape[i];
            let stride: u64 = shape[i + 1..].iter().product();
            let g = GroupShape::of_axis(size, stride, gpus_per_node);
            let link = if size <= 1 {
                LinkKind::Unused
            } else if g.nodes() <= 1 {
                LinkKind::NvLink
            } else {
                LinkKind::InfiniBand
            };
            AxisLink {
                axis: axes[i].clone(),
                size,
                stride,
                per_node: g.per_node,
                nodes: g.nodes(),
                link,
            }
        })
        .collect()
}

const NVLINK: Rgb = Rgb(0x2c, 0xa0, 0x2c);
const IB: Rgb = Rgb(0xff, 0x7f, 0x0e);
const UNUSED: Rgb = Rgb(0xbb, 0xbb, 0xbb);

/// Stage colours (cycled past ten stages).
pub const STAGE_COLORS: [Rgb; 10] = [
    Rgb(0x4e, 0x79, 0xa7),
    Rgb(0xf2, 0x8e, 0x2b),
    Rgb(0xe1, 0x57, 0x59),
    Rgb(0x76, 0xb7, 0xb2),
    Rgb(0x59, 0xa1, 0x4f),
    Rgb(0xed, 0xc9, 0x48),
    Rgb(0xb0, 0x7a, 0xa1),
    Rgb(0xff, 0x9d, 0xa7),
    Rgb(0x9c, 0x75, 0x5f),
    Rgb(0xba, 0xb0, 0xac),
];

fn link_class(l: LinkKind) -> (&'static str, Rgb, &'static str) {
    match l {
        LinkKind::NvLink => ("nvlink", NVLINK, "NVLink"),
        LinkKind::InfiniBand => ("ib", IB, "InfiniBand"),
        LinkKind::Unused => ("unused", UNUSED, "-"),
    }
}

fn coords(rank: u64, shape: &[u64]) -> Vec<u64> {
    let mut out = vec![0; shape.len()];
    let mut r = rank;
    for i in (0..shape.len()).rev() {
        out[i] = r % shape[i].max(1);
        r /= shape[i].max(1);
    }
    out
}

/// Draws the mesh map.
pub fn mesh_map(m: &MeshDesc) -> Canvas {
    let width: f64 = 1200.0;
    let gpn = m.gpus_per_node.max(1);
    let world: u64 = m.shape.iter().product();
    let links = axis_links(&m.axes, &m.shape, gpn);
    let pp_axis = m.axes.iter().position(|a| a == "pp");
    let stage_of = |r: u64| pp_axis.map(|i| coords(r, &m.shape)[i]).unwrap_or(0);
    let pp = pp_axis.map(|i| m.shape[i]).unwrap_or(1);
    let nodes = world.div_ceil(gpn).max(1);

    // Node grid geometry.
    let (cell_w, cell_h): (f64, f64) = if nodes <= 16 {
        (64.0, 40.0)
    } else if nodes <= 128 {
        (44.0, 28.0)
    } else {
        (34.0, 22.0)
    };
    let cols = (((width - 20.0) / (cell_w + 4.0)).floor() as u64).clamp(1, nodes);
    let rows = nodes.div_ceil(cols);
    let stage_lines = pp.min(16);
    let axes_y = 50.0;
    let grid_y = axes_y + 22.0 * links.len() as f64 + 40.0;
    let legend_y = grid_y + rows as f64 * (cell_h + 4.0) + 20.0;
    let legend_rows = stage_lines.div_ceil(4);
    let detail_y = legend_y + legend_rows as f64 * 18.0 + 50.0;
    let groups_y = detail_y + 80.0;
    let height = groups_y + 20.0 * links.len() as f64 + 20.0;
    let mut c = Canvas::new(width, height);
    c.text(10.0, 22.0, 15.0, Anchor::Start, &m.title, "title");

    // Axes and their links.
    for (i, l) in links.iter().enumerate() {
        let y = axes_y + 22.0 * i as f64;
        let (class, color, name) = link_class(l.link);
        c.rect(10.0, y - 11.0, 14.0, 14.0, color, &format!("axis-{class}"))
            .with("axis", &l.axis);
        let what = match l.link {
            LinkKind::Unused => "size 1, no communication".to_string(),
            LinkKind::NvLink => format!("a group of {} GPUs inside one node", l.size),
            LinkKind::InfiniBand => format!(
                "a group of {} GPUs over {} nodes, {} per node",
                l.size, l.nodes, l.per_node
            ),
        };
        c.text(
            32.0,
            y,
            12.0,
            Anchor::Start,
            &format!(
                "{:<3} size {:<5} stride {:<6} {:<50} {name}",
                l.axis, l.size, l.stride, what
            ),
            "axis",
        );
    }

    // Every node, coloured by the stage of its GPUs.
    c.text(
        10.0,
        grid_y - 12.0,
        12.0,
        Anchor::Start,
        &format!("{nodes} nodes x {gpn} GPUs, colour = pipeline stage"),
        "heading",
    );
    for n in 0..nodes {
        let (col, row) = (n % cols, n / cols);
        let x = 10.0 + col as f64 * (cell_w + 4.0);
        let y = grid_y + row as f64 * (cell_h + 4.0);
        let first = n * gpn;
        let last = ((n + 1) * gpn).min(world) - 1;
        let (s0, s1) = (stage_of(first), stage_of(last));
        if s0 == s1 {
            c.rect(
                x,
                y,
                cell_w,
                cell_h,
                STAGE_COLORS[(s0 % 10) as usize],
                "node",
            )
            .with("n", n)
            .with("s", s0);
        } else {
            // Several stages share the node: one stripe per GPU.
            let gw = cell_w / gpn as f64;
            for r in first..=last {
                let s = stage_of(r);
                c.rect(
                    x + (r - first) as f64 * gw,
                    y,
                    gw,
                    cell_h,
                    STAGE_COLORS[(s % 10) as usize],
                    "gpu-stripe",
                )
                .with("n", n)
                .with("s", s);
            }
        }
        if nodes <= 128 {
            c.text(
                x + cell_w / 2.0,
                y + cell_h / 2.0 + 4.0,
                10.0,
                Anchor::Middle,
                &n.to_string(),
                "node",
            );
        }
    }
    // Stage legend: which nodes each stage occupies.
    let stage_ranks = world / pp.max(1);
    for s in 0..stage_lines {
        let (col, row) = (s % 4, s / 4);
        let x = 10.0 + col as f64 * 290.0;
        let y = legend_y + row as f64 * 18.0;
        let (a, b) = (s * stage_ranks / gpn, ((s + 1) * stage_ranks - 1) / gpn);
        c.rect(
            x,
            y - 10.0,
            12.0,
            12.0,
            STAGE_COLORS[(s % 10) as usize],
            "legend",
        );
        let nodes_txt = if a == b {
            format!("node {a}")
        } else {
            format!("nodes {a}-{b}")
        };
        c.text(
            x + 18.0,
            y,
            11.0,
            Anchor::Start,
            &format!("stage {s}: {nodes_txt}"),
            "legend",
        );
    }
    if pp > stage_lines {
        c.text(
            10.0,
            legend_y + legend_rows as f64 * 18.0,
            11.0,
            Anchor::Start,
            &format!("... {} stages in all", pp),
            "legend",
        );
    }

    // Node 0 GPU by GPU, with the groups that stay inside it.
    c.text(
        10.0,
        detail_y - 14.0,
        12.0,
        Anchor::Start,
        "node 0, GPU by GPU (outlines: groups inside the node)",
        "heading",
    );
    let gw = ((width - 20.0) / gpn.min(world) as f64).min(140.0);
    for r in 0..gpn.min(world) {
        let x = 10.0 + r as f64 * gw;
        let s = stage_of(r);
        c.rect(
            x + 2.0,
            detail_y,
            gw - 4.0,
            44.0,
            STAGE_COLORS[(s % 10) as usize],
            "gpu",
        )
        .with("rank", r);
        c.text(
            x + gw / 2.0,
            detail_y + 18.0,
            11.0,
            Anchor::Middle,
            &format!("rank {r}"),
            "gpu",
        );
        let co = coords(r, &m.shape);
        let label: Vec<String> = m
            .axes
            .iter()
            .zip(&co)
            .zip(&m.shape)
            .filter(|(_, &n)| n > 1)
            .map(|((a, v), _)| format!("{a}{v}"))
            .collect();
        let label = label.join(" ");
        let size = if text_width(&label, 9.0) > gw - 6.0 {
            7.0
        } else {
            9.0
        };
        c.text(
            x + gw / 2.0,
            detail_y + 34.0,
            size,
            Anchor::Middle,
            &label,
            "gpu",
        );
    }
    let mut inset = 0.0;
    for l in links.iter().rev() {
        if l.link != LinkKind::NvLink {
            continue;
        }
        // A group of this axis inside node 0: ranks base + j * stride.
        let span = l.size * l.stride;
        let blocks = gpn.min(world) / span.max(1);
        for b in 0..blocks.max(1) {
            for off in 0..l.stride.min(gpn) {
                let first = b * span + off;
                let last = first + (l.size - 1) * l.stride;
                if last >= gpn.min(world) {
                    continue;
                }
                // Contiguous groups get one box; strided ones one box per member.
                if l.stride == 1 {
                    c.outline(
                        10.0 + first as f64 * gw + inset,
                        detail_y - 3.0 - inset,
                        l.size as f64 * gw - 2.0 * inset,
                        50.0 + 2.0 * inset,
                        NVLINK,
                        2.0,
                        &format!("group-{}", l.axis),
                    );
                } else if off == 0 {
                    for j in 0..l.size {
                        let r = first + j * l.stride;
                        c.outline(
                            10.0 + r as f64 * gw + 1.0 + inset,
                            detail_y - 1.0 - inset,
                            gw - 2.0 - 2.0 * inset,
                            46.0 + 2.0 * inset,
                            NVLINK,
                            1.0,
                            &format!("group-{}", l.axis),
                        );
                    }
                }
            }
        }
        inset += 3.0;
    }

    // Rank 0's group on every axis.
    c.text(
        10.0,
        groups_y - 14.0,
        12.0,
        Anchor::Start,
        "rank 0's group on each axis",
        "heading",
    );
    for (i, l) in links.iter().enumerate() {
        let y = groups_y + 20.0 * i as f64;
        let (class, color, name) = link_class(l.link);
        let members: Vec<u64> = (0..l.size).map(|j| j * l.stride).collect();
        let mut node_list: Vec<u64> = members.iter().map(|r| r / gpn).collect();
        node_list.dedup();
        let list = |v: &[u64]| -> String {
            if v.len() <= 6 {
                v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
            } else {
                format!("{}, {}, {}, ..., {}", v[0], v[1], v[2], v[v.len() - 1])
            }
        };
        c.rect(10.0, y - 11.0, 14.0, 14.0, color, &format!("link-{class}"));
        c.text(
            32.0,
            y,
            12.0,
            Anchor::Start,
            &format!(
                "{:<3} ranks {} on node{} {} ({name})",
                l.axis,
                list(&members),
                if node_list.len() > 1 { "s" } else { "" },
                list(&node_list)
            ),
            "group",
        );
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn tp_inside_a_node_is_nvlink_and_axes_over_nodes_are_infiniband() {
        let axes = names(&["pp", "dp", "cp", "tp"]);
        let l = axis_links(&axes, &[8, 60, 1, 8], 8);
        let kinds: Vec<LinkKind> = l.iter().map(|a| a.link).collect();
        assert_eq!(
            kinds,
            [
                LinkKind::InfiniBand,
                LinkKind::InfiniBand,
                LinkKind::Unused,
                LinkKind::NvLink
            ]
        );
        assert_eq!(l[1].nodes, 60);
        // tp larger than a node crosses InfiniBand; a small dp after a small tp fits.
        let l = axis_links(&axes, &[1, 2, 1, 16], 8);
        assert_eq!(l[3].link, LinkKind::InfiniBand);
        let l = axis_links(&axes, &[2, 4, 1, 2], 8);
        assert_eq!(l[1].link, LinkKind::NvLink);
        assert_eq!(l[0].link, LinkKind::InfiniBand);
    }
}
