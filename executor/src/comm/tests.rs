//! Every operation against a serial reference, byte counts against the cost model's
//! formulas, determinism, and failures that must end every rank quickly.

use super::*;
use meshplan_ir::plan::CollectiveKind;
use std::time::Instant;

mod failures;

const LONG: Option<Duration> = Some(Duration::from_secs(30));

impl CommKind {
    /// The plan's collective this kind carries out, for comparing measured counts
    /// with a plan's `collective` instructions (`AllToAllV` is the plan's
    /// `AllToAll` with uneven splits); `None` for point-to-point and barriers.
    fn plan_kind(self) -> Option<CollectiveKind> {
        match self {
            CommKind::AllReduce => Some(CollectiveKind::AllReduce),
            CommKind::AllGather => Some(CollectiveKind::AllGather),
            CommKind::ReduceScatter => Some(CollectiveKind::ReduceScatter),
            CommKind::Broadcast => Some(CollectiveKind::Broadcast),
            CommKind::AllToAll | CommKind::AllToAllV => Some(CollectiveKind::AllToAll),
            CommKind::Send | CommKind::Recv | CommKind::Barrier => None,
        }
    }
}

/// Input of member `member` for test `salt`: non-integers of mixed sign, so a
/// different summation order would change the bits.
fn data(member: usize, len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let k = (member * 31 + i * 7 + salt * 13) % 23;
            (k as f32 - 11.0) * 0.3713 + (member as f32) * 1e-3
        })
        .collect()
}

/// Serial sum in group order.
fn serial_sum(parts: &[Vec<f32>]) -> Vec<f32> {
    let mut out = parts[0].clone();
    for p in &parts[1..] {
        for (o, x) in out.iter_mut().zip(p) {
            *o += *x;
        }
    }
    out
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn jitter(state: &mut u64) {
    let us = xorshift(state) % 400;
    std::thread::sleep(Duration::from_micros(us));
}

fn all_ok<T: std::fmt::Debug>(results: Vec<Result<T, RankError>>) -> Vec<T> {
    let summary = failure_summary(&results);
    assert!(summary.is_none(), "unexpected failure: {summary:?}");
    results
        .into_iter()
        .map(|r| r.expect("checked above"))
        .collect()
}

/// `(n-1)/n * bytes` as a reduced fraction (times `mult`).
fn frac(mult: u128, n: u128, bytes: u128) -> (u128, u128) {
    if n <= 1 {
        return (0, 1);
    }
    let (num, den) = (mult * (n - 1) * bytes, n);
    let mut g = num.max(1);
    let mut b = den;
    while b != 0 {
        (g, b) = (b, g % b);
    }
    (num / g, den / g)
}

/// What one rank got from each collective, for comparison with the reference.
#[derive(Debug, Default)]
struct Outputs {
    all_reduce: Vec<f32>,
    all_gather: Vec<f32>,
    reduce_scatter: Vec<f32>,
    broadcast: Vec<f32>,
    all_to_all: Vec<f32>,
    counts: ByteCounts,
}

const AR_LEN: usize = 5;
const AG_LEN: usize = 3;
const RS_PART: usize = 2;
const BC_LEN: usize = 4;
const A2A_PART: usize = 2;

/// Runs every collective once on `group` (world `world`) and returns each rank's
/// outputs, index = rank.
fn run_all_collectives(world: usize, group: &Group) -> Vec<Outputs> {
    let n = group.size();
    let root = n - 1;
    all_ok(run_ranks(world, LONG, 1, |mut c| {
        let me = group.index_of(c.rank()).ok_or("not in group")?;
        let mut o = Outputs::default();
        let mut buf = data(me, AR_LEN, 1);
        c.all_reduce(group, "tp", &mut buf)?;
        o.all_reduce = buf;
        let mut out = vec![0.0; n * AG_LEN];
        c.all_gather(group, "dp", &data(me, AG_LEN, 2), &mut out)?;
        o.all_gather = out;
        let mut out = vec![0.0; RS_PART];
        c.reduce_scatter(group, "dp", &data(me, n * RS_PART, 3), &mut out)?;
        o.reduce_scatter = out;
        let mut buf = if me == root {
            data(me, BC_LEN, 4)
        } else {
            vec![0.0; BC_LEN]
        };
        c.broadcast(group, "pp", &mut buf, root)?;
        o.broadcast = buf;
        let mut out = vec![0.0; n * A2A_PART];
        c.all_to_all(group, "ep", &data(me, n * A2A_PART, 5), &mut out)?;
        o.all_to_all = out;
        c.barrier(group)?;
        o.counts = c.counts();
        Ok(o)
    }))
}

fn check_against_reference(group: &Group, outs: &[Outputs]) {
    let n = group.size();
    let ar = serial_sum(&(0..n).map(|m| data(m, AR_LEN, 1)).collect::<Vec<_>>());
    let ag: Vec<f32> = (0..n).flat_map(|m| data(m, AG_LEN, 2)).collect();
    let rs_full = serial_sum(&(0..n).map(|m| data(m, n * RS_PART, 3)).collect::<Vec<_>>());
    let bc = data(n - 1, BC_LEN, 4);
    for (me, &rank) in group.ranks.iter().enumerate() {
        let o = &outs[rank];
        assert_eq!(o.all_reduce, ar, "all_reduce n={n} member {me}");
        assert_eq!(o.all_gather, ag, "all_gather n={n} member {me}");
        assert_eq!(
            o.reduce_scatter,
            rs_full[me * RS_PART..(me + 1) * RS_PART],
            "reduce_scatter n={n} member {me}"
        );
        assert_eq!(o.broadcast, bc, "broadcast n={n} member {me}");
        let a2a: Vec<f32> = (0..n)
            .flat_map(|src| data(src, n * A2A_PART, 5)[me * A2A_PART..(me + 1) * A2A_PART].to_vec())
            .collect();
        assert_eq!(o.all_to_all, a2a, "all_to_all n={n} member {me}");

        // Byte counts: the cost model's bytes_sent_per_rank, exactly.
        let c = &o.counts;
        let nn = n as u128;
        let expect = [
            (CommKind::AllReduce, "tp", frac(2, nn, 4 * AR_LEN as u128)),
            (
                CommKind::AllGather,
                "dp",
                frac(1, nn, 4 * (n * AG_LEN) as u128),
            ),
            (
                CommKind::ReduceScatter,
                "dp",
                frac(1, nn, 4 * (n * RS_PART) as u128),
            ),
            (
                CommKind::Broadcast,
                "pp",
                if n > 1 {
                    (4 * BC_LEN as u128, 1)
                } else {
                    (0, 1)
                },
            ),
            (
                CommKind::AllToAll,
                "ep",
                frac(1, nn, 4 * (n * A2A_PART) as u128),
            ),
        ];
        for (kind, axis, exact) in expect {
            let k = c.get(kind, axis).expect("counted");
            assert_eq!(k.calls, 1, "{kind} calls n={n}");
            assert_eq!(k.bytes_sent_exact(), Some(exact), "{kind} bytes n={n}");
            let f = exact.0 as f64 / exact.1 as f64;
            assert!((k.bytes_sent() - f).abs() <= 1e-12 * f.max(1.0), "{kind}");
        }
        // The cost model's f64 formula, per axis.
        let fr = (n as f64 - 1.0) / n as f64;
        let dp = fr * (4 * n * AG_LEN) as f64 + fr * (4 * n * RS_PART) as f64;
        assert!((c.axis_bytes_sent("dp") - dp).abs() < 1e-9, "dp n={n}");
        let tp = 2.0 * fr * (4 * AR_LEN) as f64;
        assert!((c.axis_bytes_sent("tp") - tp).abs() < 1e-9, "tp n={n}");
        let ax = c.to_axis_bytes().expect("known axes");
        assert_eq!(ax.dp, c.per_axis()["dp"]);
        assert_eq!(ax.ep, c.axis_bytes_sent("ep"));
        // Barriers are not counted.
        assert!(c.iter().all(|(k, _, _)| k != CommKind::Barrier));
    }
}

#[test]
fn collectives_match_serial_reference_on_groups_of_1_to_4() {
    for n in 1..=4 {
        let group = Group::world(n);
        let outs = run_all_collectives(n, &group);
        check_against_reference(&group, &outs);
        if n == 1 {
            // A group of one sends nothing but still counts its calls.
            let c = &outs[0].counts;
            assert_eq!(c.calls(CommKind::AllReduce, "tp"), 1);
            assert_eq!(c.per_axis().values().sum::<f64>(), 0.0);
        }
    }
}

#[test]
fn a_small_collective_missing_beside_gigabytes_is_a_byte_gap() {
    // A vocabulary-parallel loss's statistics (2 x 8 rows x 4 bytes = 64 bytes)
    // missing from 4 GiB of tensor-parallel traffic: 1.5e-8 of it.
    let want = 4.0 * (1u64 << 30) as f64;
    let gap = crate::comm::byte_gap("rank 0 tp", want - 64.0, want);
    assert_eq!(
        gap.as_deref(),
        Some("rank 0 tp: measured 4294967232 bytes, plan 4294967296")
    );
    // f64 rounding of sums, 1e-13 of the total, is no gap; half a byte is one.
    assert_eq!(crate::comm::byte_gap("r", want * (1.0 + 1e-13), want), None);
    assert!(crate::comm::byte_gap("r", 0.5, 1.0).is_some());
}

#[test]
fn a_message_never_received_fails_the_run_though_every_rank_returned() {
    // Sends are buffered: rank 0's second send waits for nobody, and rank 1 returns
    // after one receive.
    let results = run_ranks(2, LONG, 1, |mut c| {
        let mut buf = [0.0f32; 3];
        match c.rank() {
            0 => {
                c.send(1, "pp", &[1.0, 2.0, 3.0])?;
                c.send(1, "pp", &[4.0, 5.0])?;
            }
            _ => c.recv(0, "pp", &mut buf)?,
        }
        Ok(())
    });
    assert!(results[0].is_ok());
    let e = results[1].as_ref().expect_err("an unread message passes");
    assert!(
        e.to_string().contains(
            "rank 0 sent rank 1 1 message(s) it never received (the first on `pp`, 2 values)"
        ),
        "{e}"
    );
    // Every message received: nothing to say.
    let results = run_ranks(2, LONG, 1, |mut c| {
        let mut buf = [0.0f32; 2];
        match c.rank() {
            0 => c.send(1, "pp", &[1.0, 2.0])?,
            _ => c.recv(0, "pp", &mut buf)?,
        }
        Ok(())
    });
    assert!(results.iter().all(Result::is_ok));
}

#[test]
fn group_order_is_the_order_of_ranks_not_rank_numbers() {
    // Members listed in reverse, inside a larger world whose other ranks idle.
    let group = Group::new("rev", vec![3, 1, 0]);
    let outs = run_all_collectives_in(4, &group);
    check_against_reference(&group, &outs);
}

/// As `run_all_collectives`, but ranks outside the group do nothing.
fn run_all_collectives_in(world: usize, group: &Group) -> Vec<Outputs> {
    let n = group.size();
    let root = n - 1;
    all_ok(run_ranks(world, LONG, 1, |mut c| {
        let Some(me) = group.index_of(c.rank()) else {
            return Ok(Outputs::default());
        };
        let mut o = Outputs::default();
        let mut buf = data(me, AR_LEN, 1);
        c.all_reduce(group, "tp", &mut buf)?;
        o.all_reduce = buf;
        let mut out = vec![0.0; n * AG_LEN];
        c.all_gather(group, "dp", &data(me, AG_LEN, 2), &mut out)?;
        o.all_gather = out;
        let mut out = vec![0.0; RS_PART];
        c.reduce_scatter(group, "dp", &data(me, n * RS_PART, 3), &mut out)?;
        o.reduce_scatter = out;
        let mut buf = if me == root {
            data(me, BC_LEN, 4)
        } else {
            vec![0.0; BC_LEN]
        };
        c.broadcast(group, "pp", &mut buf, root)?;
        o.broadcast = buf;
        let mut out = vec![0.0; n * A2A_PART];
        c.all_to_all(group, "ep", &data(me, n * A2A_PART, 5), &mut out)?;
        o.all_to_all = out;
        o.counts = c.counts();
        Ok(o)
    }))
}

#[test]
fn mesh_2x2_tp_and_dp_groups_run_interleaved() {
    // Rank = 2 * dp_coord + tp_coord: tp groups {0,1},{2,3}, dp groups {0,2},{1,3}.
    // Even ranks go tp first, odd ranks dp first, with random sleeps, so the two
    // kinds of groups really overlap.
    const ITERS: usize = 40;
    const LEN: usize = 6;
    let tp = |r: usize| Group::new("tp", vec![r / 2 * 2, r / 2 * 2 + 1]);
    let dp = |r: usize| Group::new("dp", vec![r % 2, r % 2 + 2]);
    let results = all_ok(run_ranks(4, LONG, 1, |mut c| {
        let r = c.rank();
        let (tg, dg) = (tp(r), dp(r));
        let (ti, di) = (r % 2, r / 2);
        let mut rng = 0x9e37_79b9_7f4a_7c15_u64 ^ (r as u64 + 1);
        let mut got = Vec::new();
        for it in 0..ITERS {
            let mut t = data(ti, LEN, it);
            let mut g = vec![0.0; 2 * LEN];
            let mut s = vec![0.0; LEN / 2];
            let tp_first = r % 2 == 0;
            for step in 0..2 {
                jitter(&mut rng);
                if (step == 0) == tp_first {
                    c.all_reduce(&tg, "tp", &mut t)?;
                } else {
                    c.all_gather(&dg, "dp", &data(di, LEN, it + 100), &mut g)?;
                    c.reduce_scatter(&dg, "dp", &data(di, LEN, it + 200), &mut s)?;
                }
            }
            got.push((t, g, s));
        }
        Ok((got, c.counts()))
    }));
    for (r, (got, counts)) in results.iter().enumerate() {
        let di = r / 2;
        for (it, (t, g, s)) in got.iter().enumerate() {
            assert_eq!(*t, serial_sum(&[data(0, LEN, it), data(1, LEN, it)]));
            let ag: Vec<f32> = [data(0, LEN, it + 100), data(1, LEN, it + 100)].concat();
            assert_eq!(*g, ag);
            let rs = serial_sum(&[data(0, LEN, it + 200), data(1, LEN, it + 200)]);
            assert_eq!(*s, rs[di * LEN / 2..(di + 1) * LEN / 2], "rank {r} it {it}");
        }
        // n = 2: all_reduce sends B, all_gather and reduce_scatter B/2.
        let b = (4 * LEN) as f64;
        assert_eq!(counts.calls(CommKind::AllReduce, "tp"), ITERS as u64);
        assert_eq!(counts.axis_bytes_sent("tp"), ITERS as f64 * b);
        assert_eq!(counts.calls(CommKind::AllGather, "dp"), ITERS as u64);
        assert_eq!(counts.axis_bytes_sent("dp"), ITERS as f64 * (b + b / 2.0));
    }
}

#[test]
fn all_reduce_is_bit_identical_across_members_and_reruns() {
    // In f32, 1e8 + 1 == 1e8, so group order gives ((1e8 + 1) - 1e8) + 1 = 1 while
    // e.g. (1e8 - 1e8) + 1 + 1 = 2: the result shows the summation order.
    let parts: [[f32; 3]; 4] = [
        [1e8, 0.1, 3.0e-4],
        [1.0, 0.2, -7.0],
        [-1e8, 0.3, 1.0e7],
        [1.0, 1e-8, -1.0e7],
    ];
    let reference = serial_sum(&parts.iter().map(|p| p.to_vec()).collect::<Vec<_>>());
    assert_eq!(reference[0], 1.0);
    let mut first: Option<Vec<u32>> = None;
    for run in 0..20u64 {
        let results = all_ok(run_ranks(4, LONG, 1, |mut c| {
            let mut rng = (run + 1).wrapping_mul(0x2545_f491_4f6c_dd1d) ^ (c.rank() as u64 + 7);
            jitter(&mut rng);
            jitter(&mut rng);
            let mut buf = parts[c.rank()].to_vec();
            c.all_reduce(&Group::world(4), "dp", &mut buf)?;
            Ok(buf.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
        }));
        for bits in &results {
            assert_eq!(*bits, results[0], "members differ in run {run}");
        }
        let want: Vec<u32> = reference.iter().map(|x| x.to_bits()).collect();
        assert_eq!(results[0], want, "run {run} differs from group-order sum");
        match &first {
            None => first = Some(results[0].clone()),
            Some(f) => assert_eq!(*f, results[0], "run {run} differs from run 0"),
        }
    }
}

#[test]
fn send_recv_keep_order_per_pair() {
    // Rank 0 sends 10 messages to 1 and to 2, interleaved; rank 2 sends 10 to 1.
    // Rank 1 drains rank 2 first, then rank 0: per-pair order must hold whatever
    // the arrival order across pairs.
    let results = all_ok(run_ranks(3, LONG, 1, |mut c| {
        let mut got = Vec::new();
        match c.rank() {
            0 => {
                for k in 0..10 {
                    c.send(1, "pp", &[k as f32, 0.0])?;
                    c.send(2, "pp", &[k as f32, 0.5, 0.5])?;
                }
            }
            1 => {
                for _ in 0..10 {
                    let mut b = [0.0; 2];
                    c.recv(2, "pp", &mut b)?;
                    got.push(b[0]);
                }
                for _ in 0..10 {
                    let mut b = [0.0; 2];
                    c.recv(0, "pp", &mut b)?;
                    got.push(b[0]);
                }
            }
            _ => {
                for k in 0..10 {
                    c.send(1, "pp", &[100.0 + k as f32, 2.0])?;
                    let mut b = [0.0; 3];
                    c.recv(0, "pp", &mut b)?;
                    got.push(b[0]);
                }
            }
        }
        Ok((got, c.counts()))
    }));
    let from2: Vec<f32> = (0..10).map(|k| 100.0 + k as f32).collect();
    let from0: Vec<f32> = (0..10).map(|k| k as f32).collect();
    assert_eq!(results[1].0, [from2, from0.clone()].concat());
    assert_eq!(results[2].0, from0);
    // Send counts B; receive counts nothing sent.
    let c0 = &results[0].1;
    assert_eq!(c0.calls(CommKind::Send, "pp"), 20);
    assert_eq!(
        c0.bytes_sent(CommKind::Send, "pp"),
        (10 * 8 + 10 * 12) as f64
    );
    let c1 = &results[1].1;
    assert_eq!(c1.calls(CommKind::Recv, "pp"), 20);
    assert_eq!(c1.axis_bytes_sent("pp"), 0.0);
    assert_eq!(
        c1.get(CommKind::Recv, "pp").map(|k| k.payload_bytes),
        Some(160)
    );
}

#[test]
fn ring_exchange_with_sends_first_does_not_deadlock() {
    let results = all_ok(run_ranks(4, LONG, 1, |mut c| {
        let r = c.rank();
        c.send((r + 1) % 4, "cp", &[r as f32; 8])?;
        let mut b = [0.0; 8];
        c.recv((r + 3) % 4, "cp", &mut b)?;
        Ok(b[0])
    }));
    assert_eq!(results, vec![3.0, 0.0, 1.0, 2.0]);
}

/// Elements member `i` sends to member `j`: uneven, with zeros.
fn a2av_count(i: usize, j: usize) -> usize {
    (i + 2 * j) % 4
}

#[test]
fn all_to_all_v_with_uneven_counts() {
    for n in 1..=4 {
        let group = Group::new("ep", (0..n).collect());
        let results = all_ok(run_ranks(n, LONG, 1, |mut c| {
            let me = c.rank();
            let send_counts: Vec<usize> = (0..n).map(|j| a2av_count(me, j)).collect();
            let recv_counts: Vec<usize> = (0..n).map(|i| a2av_count(i, me)).collect();
            // Element k for member j encodes (src, dst, k).
            let send: Vec<f32> = (0..n)
                .flat_map(|j| (0..a2av_count(me, j)).map(move |k| (me * 100 + j * 10 + k) as f32))
                .collect();
            let mut recv = vec![-1.0; recv_counts.iter().sum()];
            c.all_to_all_v(&group, "ep", &send, &send_counts, &mut recv, &recv_counts)?;
            Ok((recv, c.counts()))
        }));
        for (me, (recv, counts)) in results.iter().enumerate() {
            let want: Vec<f32> = (0..n)
                .flat_map(|i| (0..a2av_count(i, me)).map(move |k| (i * 100 + me * 10 + k) as f32))
                .collect();
            assert_eq!(*recv, want, "n={n} member {me}");
            let to_others: usize = (0..n).filter(|&j| j != me).map(|j| a2av_count(me, j)).sum();
            let all: usize = (0..n).map(|j| a2av_count(me, j)).sum();
            let k = counts.get(CommKind::AllToAllV, "ep").expect("counted");
            assert_eq!(k.calls, 1);
            assert_eq!(k.payload_bytes, 4 * all as u64);
            assert_eq!(k.bytes_sent_exact(), Some((4 * to_others as u128, 1)));
        }
    }
}

#[test]
fn all_to_all_v_with_inconsistent_counts_fails_on_every_member() {
    let group = Group::world(2);
    let start = Instant::now();
    let results = run_ranks(2, LONG, 1, |mut c| {
        // Rank 0 sends 2 elements to rank 1, which expects 3.
        let (sc, rc): ([usize; 2], [usize; 2]) = if c.rank() == 0 {
            ([1, 2], [1, 1])
        } else {
            ([1, 1], [3, 1])
        };
        let send = vec![0.0; sc.iter().sum()];
        let mut recv = vec![0.0; rc.iter().sum()];
        c.all_to_all_v(&group, "ep", &send, &sc, &mut recv, &rc)?;
        Ok(())
    });
    assert!(start.elapsed() < Duration::from_secs(2));
    for r in &results {
        match r {
            Err(RankError::Comm(CommError::Mismatch { detail, .. })) => {
                assert!(detail.contains("rank 0 sends 2 elements to rank 1, which expects 3"))
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn counts_merge_and_plan_kinds() {
    let mut a = ByteCounts::new();
    a.record(CommKind::AllReduce, "tp", 12, 16, 3);
    let mut b = ByteCounts::new();
    b.record(CommKind::AllReduce, "tp", 12, 16, 3);
    b.record(CommKind::Send, "pp", 8, 8, 1);
    a.merge(&b);
    assert_eq!(a.calls(CommKind::AllReduce, "tp"), 2);
    assert_eq!(
        a.get(CommKind::AllReduce, "tp")
            .and_then(KindCount::bytes_sent_exact),
        Some((32, 3))
    );
    assert_eq!(a.axis_bytes_sent_exact("tp"), Some((32, 3)));
    assert_eq!(a.axis_bytes_sent("pp"), 8.0);
    let mut bad = ByteCounts::new();
    bad.record(CommKind::Send, "xy", 4, 4, 1);
    assert!(bad.to_axis_bytes().is_err());
    assert_eq!(
        CommKind::AllToAllV.plan_kind(),
        Some(CollectiveKind::AllToAll)
    );
    assert_eq!(CommKind::Recv.plan_kind(), None);
}

/// An All-Reduce of 8 fp32 elements over 4 members on `tp` (`B` = 32 bytes, sent
/// `2 * 3/4 * 32` = 48) and one of 2 elements the plan prices in fp32 (`B` = 8,
/// sent 12), restated for a bf16 plan (hand-worked): the first at 2 bytes an
/// element, 24, the fixed one as it was, 12; 36 in all. At fp32 nothing changes.
#[test]
fn counts_restate_at_the_plans_element_size_but_what_it_prices_in_fp32() {
    let mut all = ByteCounts::new();
    all.record_ring(CommKind::AllReduce, "tp", 4, bytes_of(8));
    all.record_ring(CommKind::AllReduce, "tp", 4, bytes_of(2));
    all.record_p2p(CommKind::Send, "pp", bytes_of(5));
    let mut fixed = ByteCounts::new();
    fixed.record_ring(CommKind::AllReduce, "tp", 4, bytes_of(2));
    assert_eq!(all.axis_bytes_sent("tp"), 60.0);
    let bf16 = all.clone().at_element_size_but(2, &fixed);
    assert_eq!(bf16.axis_bytes_sent_exact("tp"), Some((36, 1)));
    assert_eq!(bf16.axis_bytes_sent("pp"), 10.0);
    assert_eq!(bf16.calls(CommKind::AllReduce, "tp"), 2);
    assert_eq!(
        bf16.get(CommKind::AllReduce, "tp").map(|c| c.payload_bytes),
        Some(8 * 2 + 2 * 4)
    );
    assert_eq!(all.clone().at_element_size_but(4, &fixed), all);
}

/// `collect` gives the in-place collectives' bits and byte counts without a
/// zero-filled output, and refuses what they refuse.
#[test]
fn collect_equals_the_in_place_collectives() {
    let (world, len) = (3, 12);
    let run = |into_new: bool| {
        all_ok(run_ranks(world, LONG, 1, |mut c| {
            let (g, me) = (Group::world(world), c.rank());
            let src = data(me, len, 5);
            let (rs, ag) = if into_new {
                let rs = c.collect(CommKind::ReduceScatter, (&g, "dp"), src.clone())?;
                (rs, c.collect(CommKind::AllGather, (&g, "tp"), src)?)
            } else {
                let (mut rs, mut ag) = (vec![0.0; len / world], vec![0.0; len * world]);
                c.reduce_scatter(&g, "dp", &src, &mut rs)?;
                c.all_gather(&g, "tp", &src, &mut ag)?;
                (rs, ag)
            };
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            Ok((bits(&rs), bits(&ag), c.counts()))
        }))
    };
    let (new, in_place) = (run(true), run(false));
    assert_eq!(new, in_place);
    let parts: Vec<Vec<f32>> = (0..world).map(|m| data(m, len, 5)).collect();
    let sum = serial_sum(&parts);
    for (me, (rs, ag, _)) in new.iter().enumerate() {
        let want: Vec<u32> = sum[me * 4..me * 4 + 4]
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(*rs, want, "rank {me}'s part of the sum");
        assert_eq!(ag.len(), len * world);
    }
    let refused = run_ranks(world, LONG, 1, |mut c| {
        let g = Group::world(world);
        let ragged = c.collect(CommKind::ReduceScatter, (&g, "dp"), vec![1.0; 10]);
        let wrong = c.collect(CommKind::AllReduce, (&g, "dp"), vec![1.0; 3]);
        Ok((
            ragged.unwrap_err().to_string(),
            wrong.unwrap_err().to_string(),
        ))
    });
    for r in refused {
        let (ragged, wrong) = r.expect("each rank reports its own refusal");
        assert_eq!(
            ragged,
            "invalid reduce_scatter arguments: input holds 10 elements, expected 3 members x 3"
        );
        assert!(
            wrong.contains("a reduce-scatter or an all-gather"),
            "{wrong}"
        );
    }
}
