//! Pipeline schedules simulated task by task: GPipe, 1F1B and interleaved 1F1B
//! (Megatron-LM's order), giving the step's makespan, each stage's idle time (the
//! bubble) and the most micro-batches any stage holds activations for.

use meshplan_ir::Schedule;

/// Inputs of one simulation. Durations are per micro-batch per virtual stage
/// (`pp * vpp` of them, virtual stage `c * pp + i` being chunk `c` of stage `i`).
#[derive(Clone, Debug)]
pub struct PipelineInput<'a> {
    /// Pipeline stages (ranks).
    pub pp: usize,
    /// Model chunks per stage.
    pub vpp: usize,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// Forward time per virtual stage.
    pub forward_s: &'a [f64],
    /// Backward time per virtual stage (recomputation included).
    pub backward_s: &'a [f64],
    /// Activation transfer between consecutive virtual stages.
    pub p2p_s: f64,
    /// Schedule.
    pub schedule: Schedule,
}

/// What the simulation found.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineResult {
    /// End of the last backward.
    pub makespan_s: f64,
    /// Busy time of the busiest stage.
    pub busiest_stage_s: f64,
    /// Largest number of (micro-batch, chunk) activation sets held at once, per stage.
    pub max_in_flight: Vec<usize>,
}

/// One task as the simulation ran it: its stage, what it was and when.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimedTask {
    /// Pipeline stage (rank).
    pub stage: usize,
    /// Local model chunk on the stage (`0..vpp`).
    pub chunk: usize,
    /// Micro-batch.
    pub mb: usize,
    /// Forward (else backward).
    pub forward: bool,
    /// Start, s from the beginning of the step.
    pub start_s: f64,
    /// End, s.
    pub end_s: f64,
}

#[derive(Clone, Copy)]
struct Task {
    forward: bool,
    mb: usize,
    chunk: usize,
}

fn stage_order(pp: usize, vpp: usize, m: usize, stage: usize, schedule: Schedule) -> Vec<Task> {
    let total = m * vpp;
    let mut order = Vec::with_capacity(2 * total);
    match schedule {
        Schedule::Gpipe => {
            order.extend((0..m).map(|mb| Task {
                forward: true,
                mb,
                chunk: 0,
            }));
            order.extend((0..m).map(|mb| Task {
                forward: false,
                mb,
                chunk: 0,
            }));
        }
        Schedule::OneFOneB | Schedule::Interleaved => {
            // Megatron's interleaved order: groups of `pp` micro-batches run through
            // chunk 0, then chunk 1, ...; backward visits chunks in reverse.
            let mut fwd = Vec::with_capacity(total);
            let mut bwd = Vec::with_capacity(total);
            let mut g = 0;
            while g * pp < m {
                let mbs = g * pp..((g + 1) * pp).min(m);
                for c in 0..vpp {
                    for mb in mbs.clone() {
                        fwd.push(Task {
                            forward: true,
                            mb,
                            chunk: c,
                        });
                        bwd.push(Task {
                            forward: false,
                            mb,
                            chunk: vpp - 1 - c,
                        });
                    }
                }
                g += 1;
            }
            let warmup = if vpp == 1 {
                (pp - stage - 1).min(total)
            } else {
                ((pp - stage - 1) * 2 + (vpp - 1) * pp).min(total)
            };
            order.extend_from_slice(&fwd[..warmup]);
            for k in 0..total - warmup {
                order.push(fwd[warmup + k]);
                order.push(bwd[k]);
            }
            order.extend_from_slice(&bwd[total - warmup..]);
        }
    }
    order
}

/// Simulates one step of the schedule.
///
/// # Assumptions
/// A stage runs its tasks in the schedule's order, each as soon as its input has
/// arrived; sends overlap with compute (no stage waits for its own send).
pub fn simulate(input: &PipelineInput<'_>) -> PipelineResult {
    run(input, None)
}

/// [`simulate`], also returning every task with its start and end, in the order the
/// simulation ran them: the schedule the estimate's step time comes from, for
/// pictures and traces.
pub fn simulate_timeline(input: &PipelineInput<'_>) -> (PipelineResult, Vec<TimedTask>) {
    let mut tasks = Vec::new();
    let r = run(input, Some(&mut tasks));
    (r, tasks)
}

fn run(input: &PipelineInput<'_>, mut record: Option<&mut Vec<TimedTask>>) -> PipelineResult {
    let (pp, vpp, m) = (input.pp.max(1), input.vpp.max(1), input.microbatches.max(1));
    let nvs = pp * vpp;
    assert_eq!(input.forward_s.len(), nvs);
    assert_eq!(input.backward_s.len(), nvs);
    let mut orders: Vec<Vec<Task>> = (0..pp)
        .map(|i| stage_order(pp, vpp, m, i, input.schedule))
        .collect();
    let mut f_done = vec![f64::NAN; nvs * m];
    let mut b_done = vec![f64::NAN; nvs * m];
    // When the task's input is available, or None if it has not been produced yet.
    let ready_at = |t: &Task, i: usize, f_done: &[f64], b_done: &[f64]| -> Option<f64> {
        let vs = t.chunk * pp + i;
        let (d, hop) = if t.forward {
            if vs == 0 {
                return Some(0.0);
            }
            (f_done[(vs - 1) * m + t.mb], input.p2p_s)
        } else if vs == nvs - 1 {
            (f_done[vs * m + t.mb], 0.0)
        } else {
            (b_done[(vs + 1) * m + t.mb], input.p2p_s)
        };
        (!d.is_nan()).then_some(d + hop)
    };
    let mut next = vec![0usize; pp];
    let mut clock = vec![0.0f64; pp];
    let mut busy = vec![0.0f64; pp];
    let mut in_flight = vec![0usize; pp];
    let mut max_in_flight = vec![0usize; pp];
    let mut remaining: usize = orders.iter().map(Vec::len).sum();
    while remaining > 0 {
        let mut progressed = false;
        for i in 0..pp {
            while next[i] < orders[i].len() {
                let t = orders[i][next[i]];
                let Some(ready) = ready_at(&t, i, &f_done, &b_done) else {
                    break;
                };
                let vs = t.chunk * pp + i;
                let dur = if t.forward {
                    input.forward_s[vs]
                } else {
                    input.backward_s[vs]
                };
                let start = clock[i].max(ready);
                let end = start + dur;
                clock[i] = end;
                if let Some(rec) = record.as_deref_mut() {
                    rec.push(TimedTask {
                        stage: i,
                        chunk: t.chunk,
                        mb: t.mb,
                        forward: t.forward,
                        start_s: start,
                        end_s: end,
                    });
                }
                busy[i] += dur;
                if t.forward {
                    f_done[vs * m + t.mb] = end;
                    in_flight[i] += 1;
                    max_in_flight[i] = max_in_flight[i].max(in_flight[i]);
                } else {
                    b_done[vs * m + t.mb] = end;
                    in_flight[i] -= 1;
                }
                next[i] += 1;
                remaining -= 1;
                progressed = true;
            }
        }
        if !progressed {
            // The interleaved order assumes whole groups of `pp` micro-batches; with a
            // partial last group a stage can wait on work queued behind its own next
            // task. Run the earliest task of its list whose input is ready instead.
            let mut moved = false;
            for i in 0..pp {
                let found = (next[i]..orders[i].len())
                    .find(|&j| ready_at(&orders[i][j], i, &f_done, &b_done).is_some());
                if let Some(j) = found {
                    orders[i][next[i]..=j].rotate_right(1);
                    moved = true;
                    break;
                }
            }
            // Tasks form a DAG, so some task is always ready.
            assert!(moved, "pipeline schedule deadlocked");
        }
    }
    PipelineResult {
        makespan_s: clock.iter().cloned().fold(0.0, f64::max),
        busiest_stage_s: busy.iter().cloned().fold(0.0, f64::max),
        max_in_flight,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pp: usize, vpp: usize, m: usize, f: f64, b: f64, schedule: Schedule) -> PipelineResult {
        let fw = vec![f / vpp as f64; pp * vpp];
        let bw = vec![b / vpp as f64; pp * vpp];
        simulate(&PipelineInput {
            pp,
            vpp,
            microbatches: m,
            forward_s: &fw,
            backward_s: &bw,
            p2p_s: 0.0,
            schedule,
        })
    }

    #[test]
    fn one_f_one_b_matches_narayanan_eq1() {
        // (m + p - 1)(t_f + t_b) for balanced stages without communication.
        for (p, m) in [(4, 8), (8, 26), (2, 12), (1, 5), (6, 3)] {
            let r = run(p, 1, m, 1.0, 2.0, Schedule::OneFOneB);
            let expect = (m + p - 1) as f64 * 3.0;
            assert!(
                (r.makespan_s - expect).abs() < 1e-9,
                "p={p} m={m}: {} vs {expect}",
                r.makespan_s
            );
            // The first stage holds min(p, m) micro-batches; the last holds one.
            assert_eq!(r.max_in_flight[0], p.min(m));
            assert_eq!(r.max_in_flight[p - 1], 1);
        }
    }

    #[test]
    fn gpipe_same_time_more_memory() {
        let r = run(4, 1, 8, 1.0, 2.0, Schedule::Gpipe);
        assert!((r.makespan_s - 11.0 * 3.0).abs() < 1e-9);
        assert_eq!(r.max_in_flight[0], 8);
    }

    #[test]
    fn interleaved_bubble_shrinks_by_v() {
        // Bubble (p-1)/(v m) of the ideal m (t_f + t_b).
        let (p, m, v) = (4, 8, 2);
        let r = run(p, v, m, 1.0, 2.0, Schedule::Interleaved);
        let ideal = m as f64 * 3.0;
        let bubble = (r.makespan_s - ideal) / ideal;
        let expect = (p - 1) as f64 / (v * m) as f64;
        assert!((bubble - expect).abs() < 1e-9, "{bubble} vs {expect}");
    }

    #[test]
    fn interleaved_with_a_partial_group_completes() {
        // 26 micro-batches on 8 stages: the last group has 2; every task still runs once.
        let r = run(8, 2, 26, 1.0, 2.0, Schedule::Interleaved);
        assert!(r.makespan_s >= 26.0 * 3.0);
        assert!((r.busiest_stage_s - 26.0 * 3.0).abs() < 1e-9);
        assert!(r.max_in_flight.iter().all(|&n| n >= 1));
    }

    #[test]
    fn timeline_is_the_simulation() {
        let fw = vec![1.0, 1.5, 1.0, 1.0];
        let bw = vec![2.0, 3.0, 2.0, 2.0];
        let input = PipelineInput {
            pp: 4,
            vpp: 1,
            microbatches: 6,
            forward_s: &fw,
            backward_s: &bw,
            p2p_s: 0.25,
            schedule: Schedule::OneFOneB,
        };
        let (r, tasks) = simulate_timeline(&input);
        assert_eq!(r, simulate(&input));
        assert_eq!(tasks.len(), 2 * 4 * 6);
        let end = tasks.iter().map(|t| t.end_s).fold(0.0, f64::max);
        assert_eq!(end, r.makespan_s);
        for s in 0..4 {
            let mut mine: Vec<&TimedTask> = tasks.iter().filter(|t| t.stage == s).collect();
            mine.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
            // A stage runs one task at a time, each as long as its duration.
            for w in mine.windows(2) {
                assert!(w[1].start_s >= w[0].end_s - 1e-12);
            }
            for t in &mine {
                let d = if t.forward { fw[s] } else { bw[s] };
                assert!((t.end_s - t.start_s - d).abs() < 1e-12);
            }
        }
        // A forward starts no earlier than the previous stage's forward plus the hop.
        for t in tasks.iter().filter(|t| t.forward && t.stage > 0) {
            let prev = tasks
                .iter()
                .find(|u| u.forward && u.stage == t.stage - 1 && u.mb == t.mb)
                .unwrap();
            assert!(t.start_s >= prev.end_s + 0.25 - 1e-12);
        }
    }

    #[test]
    fn p2p_delays_the_pipeline() {
        let fw = vec![1.0; 4];
        let bw = vec![2.0; 4];
        let base = PipelineInput {
            pp: 4,
            vpp: 1,
            microbatches: 8,
            forward_s: &fw,
            backward_s: &bw,
            p2p_s: 0.0,
            schedule: Schedule::OneFOneB,
        };
        let slow = PipelineInput {
            p2p_s: 0.1,
            ..base.clone()
        };
        assert!(simulate(&slow).makespan_s > simulate(&base).makespan_s);
    }
}
