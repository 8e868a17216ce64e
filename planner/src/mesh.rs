//! A device mesh: named axes (`dp`, `tp`, `cp`, `ep`) over a group of ranks, each axis
//! placed on the cluster as a [`GroupShape`] so that its collectives are priced over
//! the links it actually spans.

use meshplan_cost_model::GroupShape;

/// One named axis of a mesh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshAxis {
    /// `dp`, `tp`, `cp`, `ep` (the name decides what the axis may split: weight
    /// gradients on `dp` are synchronised once per step and may use ZeRO; ring or
    /// Ulysses attention runs on `cp`; experts split on `ep`).
    pub name: String,
    /// Ranks along the axis.
    pub size: u64,
    /// How the axis's groups sit on nodes.
    pub group: GroupShape,
}

/// An n-dimensional array of ranks with named axes; the last axis is innermost
/// (neighbouring ranks), so it is the one that stays inside a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mesh {
    /// Axes, outermost first.
    pub axes: Vec<MeshAxis>,
}

impl Mesh {
    /// A mesh from `(name, size)` pairs, outermost first, on nodes of
    /// `gpus_per_node` GPUs filled in rank order.
    pub fn new(axes: &[(&str, u64)], gpus_per_node: u64) -> Mesh {
        let mut stride = 1;
        let mut out: Vec<MeshAxis> = Vec::with_capacity(axes.len());
        for &(name, size) in axes.iter().rev() {
            out.push(MeshAxis {
                name: name.to_string(),
                size: size.max(1),
                group: GroupShape::of_axis(size.max(1), stride, gpus_per_node),
            });
            stride *= size.max(1);
        }
        out.reverse();
        Mesh { axes: out }
    }

    /// One axis, e.g. `Mesh::one_d("tp", 8, 8)`: eight ranks of one node.
    pub fn one_d(name: &str, size: u64, gpus_per_node: u64) -> Mesh {
        Mesh::new(&[(name, size)], gpus_per_node)
    }

    /// Two axes, `outer x inner` (e.g. `dp x tp` with `tp` innermost).
    pub fn two_d(outer: (&str, u64), inner: (&str, u64), gpus_per_node: u64) -> Mesh {
        Mesh::new(&[outer, inner], gpus_per_node)
    }

    /// Ranks in the mesh.
    pub fn ranks(&self) -> u64 {
        self.axes.iter().map(|a| a.size).product()
    }

    /// Axis sizes, outermost first.
    pub fn sizes(&self) -> Vec<u64> {
        self.axes.iter().map(|a| a.size).collect()
    }

    /// Index of the axis called `name`.
    pub fn axis(&self, name: &str) -> Option<usize> {
        self.axes.iter().position(|a| a.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inner_axis_stays_in_node() {
        let m = Mesh::two_d(("dp", 4), ("tp", 8), 8);
        assert_eq!(m.ranks(), 32);
        assert_eq!(
            m.axes[1].group,
            GroupShape {
                size: 8,
                per_node: 8
            }
        );
        assert_eq!(
            m.axes[0].group,
            GroupShape {
                size: 4,
                per_node: 1
            }
        );
        assert_eq!(m.axis("tp"), Some(1));
        assert_eq!(m.axis("ep"), None);
        let one = Mesh::one_d("tp", 2, 8);
        assert_eq!(
            one.axes[0].group,
            GroupShape {
                size: 2,
                per_node: 2
            }
        );
    }
}
