//! DTensor / SBP placements: how one tensor lies on one mesh axis.
//!
//! A tensor's placement on a mesh is one [`Placement`] per axis. `Shard(d)` splits
//! dimension `d` evenly over the axis, `Replicate` keeps a full copy on every rank,
//! `Partial` holds a pending sum (each rank has an addend of the full tensor).

use std::fmt;

/// How a tensor lies on one mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Placement {
    /// Dimension `d` split evenly over the axis.
    Shard(u8),
    /// A full copy on every rank of the axis.
    Replicate,
    /// Every rank holds an addend; the tensor is their sum (a reduction is pending).
    Partial,
}

impl Placement {
    /// Whether the placement splits a dimension.
    pub fn is_shard(self) -> bool {
        matches!(self, Placement::Shard(_))
    }

    /// The placement of this tensor's gradient as the producer needs it: a sharded
    /// tensor's gradient is sharded alike, and the gradient of a replicated or of a
    /// partial tensor is replicated (every addend of a sum receives the whole gradient).
    pub fn grad(self) -> Placement {
        match self {
            Placement::Shard(d) => Placement::Shard(d),
            Placement::Replicate | Placement::Partial => Placement::Replicate,
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "S({d})"),
            Placement::Replicate => f.write_str("R"),
            Placement::Partial => f.write_str("P"),
        }
    }
}

/// The per-axis strings of a placement, as `plan.json` writes them (`["S(0)", "R"]`).
pub fn placement_strings(p: &[Placement]) -> Vec<String> {
    p.iter().map(|x| x.to_string()).collect()
}

/// Elements of a tensor of `dims` (evaluated sizes) held by one rank under `p`, where
/// `sizes` are the mesh axis sizes. A partial tensor is full-sized.
pub fn local_fraction(p: &[Placement], sizes: &[u64]) -> f64 {
    p.iter()
        .zip(sizes)
        .map(|(pl, &n)| {
            if pl.is_shard() {
                1.0 / n.max(1) as f64
            } else {
                1.0
            }
        })
        .product()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_and_grad() {
        assert_eq!(Placement::Shard(0).to_string(), "S(0)");
        assert_eq!(Placement::Replicate.to_string(), "R");
        assert_eq!(Placement::Partial.to_string(), "P");
        assert_eq!(Placement::Partial.grad(), Placement::Replicate);
        assert_eq!(Placement::Shard(2).grad(), Placement::Shard(2));
        assert_eq!(
            placement_strings(&[Placement::Shard(1), Placement::Replicate]),
            vec!["S(1)".to_string(), "R".to_string()]
        );
        assert_eq!(
            local_fraction(&[Placement::Shard(1), Placement::Partial], &[4, 2]),
            0.25
        );
    }
}
