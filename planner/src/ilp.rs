//! A generic one-hot strategy-selection problem and its exact solvers.
//!
//! Nodes choose one strategy each (cost, memory); an edge between two nodes prices
//! every pair of their strategies (`None`: the pair is forbidden). Minimise the sum of
//! chosen node costs and edge costs, optionally under a memory limit (sum of chosen
//! node memories). [`solve`] writes it as an ILP for good_lp (microlp; HiGHS with the
//! `highs` feature) after exact reductions; [`brute_force`] enumerates every
//! assignment; [`evaluate`] prices one assignment and is the objective both share.
//!
//! Edge costs are linearised per edge over *classes*: strategies of a node that an
//! edge cannot tell apart (equal rows of its cost matrix) share edge variables. With
//! `e_pq >= 0`, `sum_q e_pq = sum_{a in p} x_a` and `sum_p e_pq = sum_{b in q} x_b`,
//! binary one-hot `x` force `e` to the product of the two choices, so the
//! linearisation is exact; forbidden pairs simply have no variable.

use good_lp::{variable, Expression, ProblemVariables, Solution as _, SolverModel, Variable};
use std::collections::HashMap;
use std::fmt;

/// One node: a cost and a memory per strategy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Node {
    /// Cost (seconds) of each strategy.
    pub cost: Vec<f64>,
    /// Memory (bytes) of each strategy.
    pub mem: Vec<f64>,
}

/// Pairwise cost between the strategies of nodes `a` and `b`.
#[derive(Clone, Debug, PartialEq)]
pub struct Edge {
    /// First node.
    pub a: usize,
    /// Second node.
    pub b: usize,
    /// `cost[sa][sb]`, `None` where the pair is forbidden.
    pub cost: Vec<Vec<Option<f64>>>,
}

/// A strategy-selection problem.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Problem {
    /// Nodes.
    pub nodes: Vec<Node>,
    /// Edges.
    pub edges: Vec<Edge>,
    /// Upper bound on the sum of chosen memories.
    pub memory_limit: Option<f64>,
}

/// Why no assignment came back.
#[derive(Clone, Debug, PartialEq)]
pub enum IlpError {
    /// A node has no strategy.
    EmptyNode(usize),
    /// No assignment satisfies the edges and the memory limit.
    Infeasible,
    /// The solver failed.
    Solver(String),
    /// Too many assignments to enumerate.
    TooLarge(f64),
    /// The problem is malformed (edge indices or matrix sizes).
    Malformed(String),
}

impl fmt::Display for IlpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IlpError::EmptyNode(n) => write!(f, "node {n} has no strategy"),
            IlpError::Infeasible => {
                f.write_str("no assignment satisfies the edges and the memory limit")
            }
            IlpError::Solver(s) => write!(f, "solver failed: {s}"),
            IlpError::TooLarge(n) => write!(f, "{n:e} assignments are too many to enumerate"),
            IlpError::Malformed(s) => write!(f, "malformed problem: {s}"),
        }
    }
}

impl std::error::Error for IlpError {}

/// Relative tolerance on the memory limit.
const MEM_TOL: f64 = 1e-9;

fn check(p: &Problem) -> Result<(), IlpError> {
    for (i, n) in p.nodes.iter().enumerate() {
        if n.cost.is_empty() {
            return Err(IlpError::EmptyNode(i));
        }
        if n.cost.len() != n.mem.len() {
            return Err(IlpError::Malformed(format!(
                "node {i}: cost and memory lengths differ"
            )));
        }
    }
    for (k, e) in p.edges.iter().enumerate() {
        let (Some(na), Some(nb)) = (p.nodes.get(e.a), p.nodes.get(e.b)) else {
            return Err(IlpError::Malformed(format!("edge {k}: unknown node")));
        };
        if e.cost.len() != na.cost.len() || e.cost.iter().any(|r| r.len() != nb.cost.len()) {
            return Err(IlpError::Malformed(format!("edge {k}: matrix size")));
        }
    }
    Ok(())
}

/// Cost and memory of an assignment (one strategy index per node); an error names the
/// first violated rule.
pub fn evaluate(p: &Problem, assign: &[usize]) -> Result<(f64, f64), String> {
    if assign.len() != p.nodes.len() {
        return Err(format!(
            "{} choices for {} nodes",
            assign.len(),
            p.nodes.len()
        ));
    }
    let (mut cost, mut mem) = (0.0, 0.0);
    for (i, (n, &s)) in p.nodes.iter().zip(assign).enumerate() {
        let (Some(c), Some(m)) = (n.cost.get(s), n.mem.get(s)) else {
            return Err(format!("node {i}: strategy {s} out of range"));
        };
        cost += c;
        mem += m;
    }
    for (k, e) in p.edges.iter().enumerate() {
        let (Some(&sa), Some(&sb)) = (assign.get(e.a), assign.get(e.b)) else {
            return Err(format!("edge {k}: unknown node"));
        };
        match e.cost.get(sa).and_then(|r| r.get(sb)) {
            Some(Some(c)) => cost += c,
            _ => {
                return Err(format!(
                    "edge {k} ({} -> {}): pair ({sa}, {sb}) forbidden",
                    e.a, e.b
                ))
            }
        }
    }
    if let Some(lim) = p.memory_limit {
        if mem > lim * (1.0 + MEM_TOL) {
            return Err(format!("memory {mem:.6e} over the limit {lim:.6e}"));
        }
    }
    Ok((cost, mem))
}

/// The best assignment by enumeration (ties: the first in lexicographic order).
/// Refuses more than `1e7` assignments.
pub fn brute_force(p: &Problem) -> Result<Vec<usize>, IlpError> {
    check(p)?;
    let total: f64 = p.nodes.iter().map(|n| n.cost.len() as f64).product();
    if total > 1e7 {
        return Err(IlpError::TooLarge(total));
    }
    let mut idx = vec![0usize; p.nodes.len()];
    let mut best: Option<(f64, Vec<usize>)> = None;
    loop {
        if let Ok((c, _)) = evaluate(p, &idx) {
            if best.as_ref().is_none_or(|(b, _)| c < *b) {
                best = Some((c, idx.clone()));
            }
        }
        let mut k = 0;
        loop {
            if k == idx.len() {
                return best.map(|(_, a)| a).ok_or(IlpError::Infeasible);
            }
            idx[k] += 1;
            if idx[k] < p.nodes[k].cost.len() {
                break;
            }
            idx[k] = 0;
            k += 1;
        }
    }
}

/// Class id of each row (`by_row`) or column of an edge matrix restricted to the kept
/// strategies: equal vectors share a class.
fn classes(e: &Edge, keep_a: &[usize], keep_b: &[usize], by_row: bool) -> (Vec<usize>, usize) {
    let key = |v: Option<f64>| v.map_or(u64::MAX, f64::to_bits);
    let mut map: HashMap<Vec<u64>, usize> = HashMap::new();
    let (outer, inner) = if by_row {
        (keep_a, keep_b)
    } else {
        (keep_b, keep_a)
    };
    let ids = outer
        .iter()
        .map(|&o| {
            let v: Vec<u64> = inner
                .iter()
                .map(|&i| {
                    let (r, c) = if by_row { (o, i) } else { (i, o) };
                    key(e.cost[r][c])
                })
                .collect();
            let n = map.len();
            *map.entry(v).or_insert(n)
        })
        .collect();
    (ids, map.len())
}

/// Exact reductions: drop strategies that no strategy of a neighbour accepts, then,
/// among strategies that every edge treats alike, those another beats on cost (and,
/// under a memory limit, on memory). Returns the kept strategy indices per node.
pub fn reduce(p: &Problem) -> Result<Vec<Vec<usize>>, IlpError> {
    check(p)?;
    let mut keep: Vec<Vec<usize>> = p
        .nodes
        .iter()
        .map(|n| (0..n.cost.len()).collect())
        .collect();
    loop {
        let mut changed = false;
        for e in &p.edges {
            let (ka, kb) = (keep[e.a].clone(), keep[e.b].clone());
            let na: Vec<usize> = ka
                .iter()
                .copied()
                .filter(|&a| kb.iter().any(|&b| e.cost[a][b].is_some()))
                .collect();
            let nb: Vec<usize> = kb
                .iter()
                .copied()
                .filter(|&b| ka.iter().any(|&a| e.cost[a][b].is_some()))
                .collect();
            if na.len() != ka.len() || nb.len() != kb.len() {
                changed = true;
                keep[e.a] = na;
                keep[e.b] = nb;
            }
        }
        if keep.iter().any(|k| k.is_empty()) {
            return Err(IlpError::Infeasible);
        }
        if !changed {
            break;
        }
    }
    // Signatures: per node, the class of each kept strategy on each incident edge.
    let mut sig: Vec<Vec<Vec<usize>>> = keep.iter().map(|k| vec![Vec::new(); k.len()]).collect();
    for e in &p.edges {
        let (ra, _) = classes(e, &keep[e.a], &keep[e.b], true);
        let (cb, _) = classes(e, &keep[e.a], &keep[e.b], false);
        for (i, c) in ra.into_iter().enumerate() {
            sig[e.a][i].push(c);
        }
        for (i, c) in cb.into_iter().enumerate() {
            sig[e.b][i].push(c);
        }
    }
    let limited = p.memory_limit.is_some();
    for (v, k) in keep.iter_mut().enumerate() {
        let node = &p.nodes[v];
        let old = k.clone();
        let mut kept = Vec::new();
        for (i, &s) in old.iter().enumerate() {
            let dominated = old.iter().enumerate().any(|(j, &t)| {
                if i == j || sig[v][i] != sig[v][j] {
                    return false;
                }
                let (cs, ct, ms, mt) = (node.cost[s], node.cost[t], node.mem[s], node.mem[t]);
                let no_worse = ct <= cs && (!limited || mt <= ms);
                let better = ct < cs || (limited && mt < ms);
                no_worse && (better || j < i)
            });
            if !dominated {
                kept.push(s);
            }
        }
        *k = kept;
    }
    Ok(keep)
}

/// The optimal assignment through the ILP, checked with [`evaluate`].
pub fn solve(p: &Problem) -> Result<Vec<usize>, IlpError> {
    let keep = reduce(p)?;
    // Trivial: every node forced.
    if keep.iter().all(|k| k.len() == 1) {
        let a: Vec<usize> = keep.iter().map(|k| k[0]).collect();
        return evaluate(p, &a).map(|_| a).map_err(|_| IlpError::Infeasible);
    }
    // Scale costs to order one for the solver.
    let scale = {
        let m = p
            .nodes
            .iter()
            .flat_map(|n| n.cost.iter())
            .chain(
                p.edges
                    .iter()
                    .flat_map(|e| e.cost.iter().flatten().flatten()),
            )
            .fold(0.0f64, |m, c| m.max(c.abs()));
        if m > 0.0 {
            1.0 / m
        } else {
            1.0
        }
    };
    let mut vars = ProblemVariables::new();
    let x: Vec<Vec<Variable>> = keep
        .iter()
        .map(|k| k.iter().map(|_| vars.add(variable().binary())).collect())
        .collect();
    let mut objective = Expression::from(0.0);
    for (v, k) in keep.iter().enumerate() {
        for (i, &s) in k.iter().enumerate() {
            objective += p.nodes[v].cost[s] * scale * x[v][i];
        }
    }
    let mut constraints = Vec::new();
    for (v, _) in keep.iter().enumerate() {
        let sum: Expression = x[v].iter().copied().sum();
        constraints.push(sum.eq(1.0));
    }
    for e in &p.edges {
        let (ra, nra) = classes(e, &keep[e.a], &keep[e.b], true);
        let (cb, ncb) = classes(e, &keep[e.a], &keep[e.b], false);
        // A representative strategy per class.
        let mut rep_a = vec![0; nra];
        for (i, &c) in ra.iter().enumerate() {
            rep_a[c] = keep[e.a][i];
        }
        let mut rep_b = vec![0; ncb];
        for (i, &c) in cb.iter().enumerate() {
            rep_b[c] = keep[e.b][i];
        }
        let mut row_sum: Vec<Expression> = vec![Expression::from(0.0); nra];
        let mut col_sum: Vec<Expression> = vec![Expression::from(0.0); ncb];
        for (pa, &sa) in rep_a.iter().enumerate() {
            for (qb, &sb) in rep_b.iter().enumerate() {
                if let Some(c) = e.cost[sa][sb] {
                    let ev = vars.add(variable().min(0.0).max(1.0));
                    objective += c * scale * ev;
                    row_sum[pa] += ev;
                    col_sum[qb] += ev;
                }
            }
        }
        for (pa, rs) in row_sum.into_iter().enumerate() {
            let xs: Expression = ra
                .iter()
                .enumerate()
                .filter(|(_, &c)| c == pa)
                .map(|(i, _)| x[e.a][i])
                .sum();
            constraints.push(rs.eq(xs));
        }
        for (qb, cs) in col_sum.into_iter().enumerate() {
            let xs: Expression = cb
                .iter()
                .enumerate()
                .filter(|(_, &c)| c == qb)
                .map(|(i, _)| x[e.b][i])
                .sum();
            constraints.push(cs.eq(xs));
        }
    }
    if let Some(lim) = p.memory_limit {
        let mscale = if lim > 0.0 { 1.0 / lim } else { 1.0 };
        let mut mem = Expression::from(0.0);
        for (v, k) in keep.iter().enumerate() {
            for (i, &s) in k.iter().enumerate() {
                mem += p.nodes[v].mem[s] * mscale * x[v][i];
            }
        }
        constraints.push(mem.leq(lim * mscale * (1.0 + MEM_TOL / 2.0)));
    }
    #[cfg(feature = "highs")]
    let mut model = vars.minimise(objective).using(good_lp::highs);
    #[cfg(not(feature = "highs"))]
    let mut model = vars.minimise(objective).using(good_lp::microlp);
    for c in constraints {
        model = model.with(c);
    }
    let sol = match model.solve() {
        Ok(s) => s,
        Err(good_lp::ResolutionError::Infeasible) => return Err(IlpError::Infeasible),
        Err(e) => return Err(IlpError::Solver(e.to_string())),
    };
    let assign: Vec<usize> = keep
        .iter()
        .enumerate()
        .map(|(v, k)| {
            let mut best = 0;
            for i in 0..k.len() {
                if sol.value(x[v][i]) > sol.value(x[v][best]) {
                    best = i;
                }
            }
            k[best]
        })
        .collect();
    for (v, k) in keep.iter().enumerate() {
        let ones = (0..k.len()).filter(|&i| sol.value(x[v][i]) > 0.5).count();
        if ones != 1 {
            return Err(IlpError::Solver(format!(
                "node {v}: {ones} strategies chosen"
            )));
        }
    }
    evaluate(p, &assign).map_err(IlpError::Solver)?;
    Ok(assign)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-built problem where the edge decides: two nodes, cheap strategies
    /// forbidden together.
    fn pair() -> Problem {
        Problem {
            nodes: vec![
                Node {
                    cost: vec![1.0, 2.0],
                    mem: vec![5.0, 1.0],
                },
                Node {
                    cost: vec![1.0, 3.0],
                    mem: vec![5.0, 1.0],
                },
            ],
            edges: vec![Edge {
                a: 0,
                b: 1,
                cost: vec![vec![None, Some(0.5)], vec![Some(0.25), Some(0.0)]],
            }],
            memory_limit: None,
        }
    }

    #[test]
    fn edge_and_memory_decide() {
        let mut p = pair();
        // (0,1): 1+3+0.5 = 4.5; (1,0): 2+1+0.25 = 3.25; (1,1): 5.
        assert_eq!(solve(&p).unwrap(), vec![1, 0]);
        assert_eq!(brute_force(&p).unwrap(), vec![1, 0]);
        assert_eq!(evaluate(&p, &[1, 0]).unwrap(), (3.25, 6.0));
        assert!(evaluate(&p, &[0, 0]).is_err());
        p.memory_limit = Some(2.0);
        assert_eq!(solve(&p).unwrap(), vec![1, 1]);
        assert_eq!(brute_force(&p).unwrap(), vec![1, 1]);
        p.memory_limit = Some(1.0);
        assert_eq!(solve(&p), Err(IlpError::Infeasible));
        assert_eq!(brute_force(&p), Err(IlpError::Infeasible));
    }

    #[test]
    fn malformed_is_an_error() {
        let mut p = pair();
        p.edges[0].b = 7;
        assert!(matches!(solve(&p), Err(IlpError::Malformed(_))));
        p.edges.clear();
        p.nodes[1].cost.clear();
        p.nodes[1].mem.clear();
        assert_eq!(brute_force(&p), Err(IlpError::EmptyNode(1)));
    }
}
