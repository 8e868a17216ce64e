//! Inter-op planning: splitting the layers into pipeline stages (Alpa's stage DP).
//!
//! Every stage runs on an identical submesh, so the sum of stage times is fixed and
//! Alpa's objective `sum_i t_i + (m - 1) max_i t_i` comes down to the bottleneck
//! `max_i t_i`. The embedding rides on the first stage and the head on the last, which
//! is why an even split is rarely the best one: a 51,200-word head costs about a layer
//! of GPT-3. Memory enters as a constraint per stage: 1F1B keeps `pp - i` micro-batches
//! of activations in flight on stage `i`, so the first stages hold the most.

/// Costs of the pieces a pipeline is cut from, per micro-batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageCosts {
    /// Forward + backward time of each block layer, in model order.
    pub layer_time_s: Vec<f64>,
    /// Bytes a layer holds whatever the schedule (weights, gradients, optimizer state).
    pub layer_static_bytes: Vec<f64>,
    /// Activation bytes a layer keeps per micro-batch in flight.
    pub layer_act_bytes: Vec<f64>,
    /// Time of the embedding, which runs on the first stage.
    pub first_time_s: f64,
    /// Time of the head (final norm, LM head, loss), which runs on the last stage.
    pub last_time_s: f64,
    /// Static bytes of the embedding.
    pub first_static_bytes: f64,
    /// Static bytes of the head.
    pub last_static_bytes: f64,
    /// Activation bytes of the embedding per micro-batch in flight.
    pub first_act_bytes: f64,
    /// Activation bytes of the head per micro-batch in flight.
    pub last_act_bytes: f64,
}

/// A memory bound per stage.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryLimit {
    /// Micro-batches in flight on each stage (1F1B: `min(pp - i, m)`).
    pub in_flight: Vec<f64>,
    /// Bytes available per GPU for the pieces above.
    pub capacity_bytes: f64,
}

/// The layers of each stage and the bottleneck time.
#[derive(Clone, Debug, PartialEq)]
pub struct Split {
    /// Block layers per stage, first stage first.
    pub layers: Vec<u64>,
    /// Time of the slowest stage per micro-batch.
    pub bottleneck_s: f64,
}

/// Prefix sums, so a stage's cost is two lookups.
struct Prefix {
    time: Vec<f64>,
    stat: Vec<f64>,
    act: Vec<f64>,
}

impl Prefix {
    fn new(c: &StageCosts) -> Prefix {
        let sums = |v: &[f64]| {
            let mut out = Vec::with_capacity(v.len() + 1);
            out.push(0.0);
            let mut acc = 0.0;
            for x in v {
                acc += x;
                out.push(acc);
            }
            out
        };
        Prefix {
            time: sums(&c.layer_time_s),
            stat: sums(&c.layer_static_bytes),
            act: sums(&c.layer_act_bytes),
        }
    }
}

/// Time and memory of stage `s` of `n` holding layers `lo..hi`.
fn stage_cost(
    c: &StageCosts,
    p: &Prefix,
    lim: Option<&MemoryLimit>,
    s: usize,
    n: usize,
    lo: usize,
    hi: usize,
) -> (f64, bool) {
    let (first, last) = (s == 0, s + 1 == n);
    let mut t = p.time[hi] - p.time[lo];
    let mut stat = p.stat[hi] - p.stat[lo];
    let mut act = p.act[hi] - p.act[lo];
    if first {
        t += c.first_time_s;
        stat += c.first_static_bytes;
        act += c.first_act_bytes;
    }
    if last {
        t += c.last_time_s;
        stat += c.last_static_bytes;
        act += c.last_act_bytes;
    }
    let fits = match lim {
        Some(l) => stat + l.in_flight.get(s).copied().unwrap_or(1.0) * act <= l.capacity_bytes,
        None => true,
    };
    (t, fits)
}

fn valid(c: &StageCosts, stages: usize, lim: Option<&MemoryLimit>) -> bool {
    let l = c.layer_time_s.len();
    stages >= 1
        && l >= stages
        && c.layer_static_bytes.len() == l
        && c.layer_act_bytes.len() == l
        && lim.is_none_or(|m| m.in_flight.len() == stages)
}

/// The split of the layers into `stages` contiguous, non-empty stages with the
/// smallest bottleneck that fits the memory limit; `None` if no split fits.
///
/// Dynamic programming over (stage, last layer): `O(stages * layers^2)`. Ties go to
/// the split that puts fewer layers on earlier stages, so the result is deterministic.
pub fn partition(c: &StageCosts, stages: usize, lim: Option<&MemoryLimit>) -> Option<Split> {
    if !valid(c, stages, lim) {
        return None;
    }
    let l = c.layer_time_s.len();
    let p = Prefix::new(c);
    // best[s][k]: smallest bottleneck of stages 0..=s covering layers 0..k.
    let mut best = vec![vec![f64::INFINITY; l + 1]; stages];
    let mut from = vec![vec![usize::MAX; l + 1]; stages];
    for k in 1..=l {
        let (t, fits) = stage_cost(c, &p, lim, 0, stages, 0, k);
        if fits {
            best[0][k] = t;
            from[0][k] = 0;
        }
    }
    for s in 1..stages {
        // Stage s ends at k and starts at j; the remaining stages need one layer each.
        for k in (s + 1)..=(l - (stages - 1 - s)) {
            for j in s..k {
                let prev = best[s - 1][j];
                if !prev.is_finite() {
                    continue;
                }
                let (t, fits) = stage_cost(c, &p, lim, s, stages, j, k);
                if !fits {
                    continue;
                }
                let v = prev.max(t);
                if v < best[s][k] {
                    best[s][k] = v;
                    from[s][k] = j;
                }
            }
        }
    }
    let bottleneck = best[stages - 1][l];
    if !bottleneck.is_finite() {
        return None;
    }
    let mut layers = vec![0u64; stages];
    let mut k = l;
    for s in (0..stages).rev() {
        let j = from[s][k];
        layers[s] = (k - j) as u64;
        k = j;
    }
    Some(Split {
        layers,
        bottleneck_s: bottleneck,
    })
}

/// Every split, for tests: the smallest bottleneck found by enumeration.
pub fn brute_force(c: &StageCosts, stages: usize, lim: Option<&MemoryLimit>) -> Option<Split> {
    if !valid(c, stages, lim) {
        return None;
    }
    let l = c.layer_time_s.len();
    let p = Prefix::new(c);
    let mut best: Option<Split> = None;
    let mut cuts = vec![0usize; stages + 1];
    #[allow(clippy::too_many_arguments)] // a recursive enumerator's state, spelled out
    fn rec(
        c: &StageCosts,
        p: &Prefix,
        lim: Option<&MemoryLimit>,
        cuts: &mut Vec<usize>,
        s: usize,
        stages: usize,
        l: usize,
        best: &mut Option<Split>,
    ) {
        if s == stages {
            if cuts[stages] != l {
                return;
            }
            let mut worst: f64 = 0.0;
            for i in 0..stages {
                let (t, fits) = stage_cost(c, p, lim, i, stages, cuts[i], cuts[i + 1]);
                if !fits {
                    return;
                }
                worst = worst.max(t);
            }
            if best.as_ref().is_none_or(|b| worst < b.bottleneck_s) {
                *best = Some(Split {
                    layers: (0..stages)
                        .map(|i| (cuts[i + 1] - cuts[i]) as u64)
                        .collect(),
                    bottleneck_s: worst,
                });
            }
            return;
        }
        let lo = cuts[s] + 1;
        let hi = if s + 1 == stages {
            l
        } else {
            l - (stages - 1 - s)
        };
        for end in lo..=hi {
            cuts[s + 1] = end;
            rec(c, p, lim, cuts, s + 1, stages, l, best);
        }
    }
    rec(c, &p, lim, &mut cuts, 0, stages, l, &mut best);
    best
}

/// Micro-batches in flight per stage under 1F1B with `m` micro-batches.
pub fn one_f_one_b_in_flight(pp: usize, m: usize) -> Vec<f64> {
    (0..pp).map(|i| (pp - i).min(m).max(1) as f64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator, so the cross-check covers many shapes.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 11) as f64) / ((1u64 << 53) as f64)
        }
    }

    fn random_costs(rng: &mut Lcg, layers: usize) -> StageCosts {
        StageCosts {
            layer_time_s: (0..layers).map(|_| 0.5 + rng.next()).collect(),
            layer_static_bytes: (0..layers).map(|_| 1.0 + rng.next()).collect(),
            layer_act_bytes: (0..layers).map(|_| rng.next()).collect(),
            first_time_s: rng.next() * 2.0,
            last_time_s: rng.next() * 3.0,
            first_static_bytes: rng.next(),
            last_static_bytes: rng.next() * 2.0,
            first_act_bytes: rng.next(),
            last_act_bytes: rng.next(),
        }
    }

    #[test]
    fn dp_equals_brute_force_up_to_six_layers_four_stages() {
        let mut rng = Lcg(7);
        let mut compared = 0;
        let mut infeasible = 0;
        for layers in 1..=6 {
            for stages in 1..=4.min(layers) {
                for case in 0..40 {
                    let c = random_costs(&mut rng, layers);
                    // Half the cases with a memory bound that sometimes binds.
                    let lim = (case % 2 == 1).then(|| MemoryLimit {
                        in_flight: one_f_one_b_in_flight(stages, 4),
                        capacity_bytes: 2.0 + 6.0 * rng.next(),
                    });
                    let dp = partition(&c, stages, lim.as_ref());
                    let bf = brute_force(&c, stages, lim.as_ref());
                    match (&dp, &bf) {
                        (Some(a), Some(b)) => {
                            assert!(
                                (a.bottleneck_s - b.bottleneck_s).abs() <= 1e-12,
                                "{layers} layers, {stages} stages: dp {a:?} vs brute force {b:?}"
                            );
                            assert_eq!(a.layers.iter().sum::<u64>(), layers as u64);
                            assert!(a.layers.iter().all(|&n| n >= 1));
                            compared += 1;
                        }
                        (None, None) => infeasible += 1,
                        _ => panic!("dp {dp:?} vs brute force {bf:?}"),
                    }
                }
            }
        }
        assert!(compared > 300, "{compared}");
        assert!(
            infeasible > 10,
            "the memory bound never bound: {infeasible}"
        );
    }

    #[test]
    fn heavy_head_gets_fewer_layers() {
        // 8 equal layers, 4 stages, a head costing 1.5 layers: the last stage takes one
        // layer, the others take the rest as evenly as they can.
        let c = StageCosts {
            layer_time_s: vec![1.0; 8],
            layer_static_bytes: vec![0.0; 8],
            layer_act_bytes: vec![0.0; 8],
            last_time_s: 1.5,
            ..StageCosts::default()
        };
        let s = partition(&c, 4, None).expect("split");
        assert_eq!(s.layers.iter().sum::<u64>(), 8);
        assert!(*s.layers.last().expect("stages") <= 1, "{s:?}");
        assert!((s.bottleneck_s - 3.0).abs() < 1e-12, "{s:?}");
        // The even split's bottleneck is 2 + 1.5.
        assert!(s.bottleneck_s < 3.5);
    }

    #[test]
    fn memory_pushes_layers_off_the_first_stage() {
        // Equal layers; activations are large, so stage 0 (4 micro-batches in flight)
        // can hold fewer layers than stage 3 (one in flight).
        let c = StageCosts {
            layer_time_s: vec![1.0; 8],
            layer_static_bytes: vec![1.0; 8],
            layer_act_bytes: vec![1.0; 8],
            ..StageCosts::default()
        };
        let lim = MemoryLimit {
            in_flight: one_f_one_b_in_flight(4, 8),
            capacity_bytes: 8.0,
        };
        let s = partition(&c, 4, Some(&lim)).expect("split");
        // Stage i holds n layers with (1 + in_flight) n bytes <= 8: at most 1, 2, 2, 4.
        assert_eq!(s.layers, vec![1, 2, 2, 3], "{s:?}");
        assert_eq!(s.layers.iter().sum::<u64>(), 8);
        let none = partition(
            &c,
            4,
            Some(&MemoryLimit {
                capacity_bytes: 6.0,
                ..lim
            }),
        );
        assert_eq!(none, None);
    }

    #[test]
    fn malformed_input_gives_none() {
        let c = StageCosts {
            layer_time_s: vec![1.0; 3],
            layer_static_bytes: vec![0.0; 3],
            layer_act_bytes: vec![0.0; 3],
            ..StageCosts::default()
        };
        assert_eq!(partition(&c, 4, None), None, "more stages than layers");
        assert_eq!(partition(&c, 0, None), None);
        let bad = StageCosts {
            layer_act_bytes: vec![0.0; 2],
            ..c
        };
        assert_eq!(partition(&bad, 2, None), None);
    }
}
