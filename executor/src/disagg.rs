//! Disaggregated serving: a `deploy` plan whose prefill pool hands each request's
//! KV cache to its decode pool, both pools ranks (threads) of one world, on any
//! [`Device`]: the caches stay in device buffers, each head's rows gathered into
//! one message on the device and scattered into the decode rank's cache by one
//! gather per layer.
//!
//! World ranks `0..P` are the prefill pool's plan (`serving.prefill_plan`, its ranks
//! numbered from 0), `P..P+D` the decode pool's (the plan's own programs). Request
//! `i` is prefilled by prefill replica `i % dp_prefill` and decoded by decode replica
//! `i % dp_decode`.
//!
//! A prefill rank runs its stage's prefill program for each of its requests, as an
//! ordinary run does; the last stage samples the first token. It then sends the
//! request's KV cache along [`meshplan_ir::kv_move::kv_route`]: every (layer, KV
//! head) piece its decode replica needs from this rank, one message each, on the
//! `kv` label, in the route's order. The prefill replica's recording rank (last
//! stage, first tensor rank) then sends the first token to each rank of the decode
//! replica's last stage (one f32 each, on the `token` label): they hand it back to
//! their first stage at the first decode step, as after an ordinary prefill.
//!
//! A decode rank receives, for each of its requests in order, the pieces its stage
//! and tensor position hold (laid out as its own prefill would have left them) and,
//! on the last stage, the first token; then it decodes its requests together with
//! the decode program, exactly as an ordinary run decodes. Sends never wait
//! (buffered), prefill ranks never receive from decode ranks, and both sides walk one
//! list in one order, so messages between any two ranks match and nothing deadlocks.
//!
//! The report merges each request's first token (prefill pool) with the rest
//! (decode pool). [`byte_mismatches`] compares every rank's bytes with the plan's:
//! each pool's own collectives (prefill passes on prefill ranks, decode steps on
//! decode ranks), the KV bytes [`meshplan_ir::kv_move::kv_transfer_bytes`] gives at
//! the model's dtype (sent by each prefill rank, received by each decode rank), and
//! the first tokens.

use crate::comm::{byte_gap, Communicator, Group, RankError};
use crate::device::{derr, Device, DeviceComm, HostDevice};
use crate::infer::{
    check_inputs, check_weights, recorded, summarize, InferOptions, InferRank, InferReport,
    PoolBytes, RequestCache, RequestOutput,
};
use crate::train::{fail, rank_outs, ExecError};
use meshplan_ir::kv_move::{kv_route, kv_transfer_bytes, pool_pos, pool_rank, KvPiece, PoolPos};
use meshplan_ir::plan::Plan;
use meshplan_ir::serving::ServingMode;
use std::time::Instant;

/// The label KV caches are counted under.
pub const KV_AXIS: &str = "kv";

/// The label the first tokens are counted under.
pub const TOKEN_AXIS: &str = "token";

/// A disaggregated run.
#[derive(Clone, Debug)]
pub struct DisaggReport {
    /// Each request's tokens (the first from the prefill pool, the rest from the
    /// decode pool), and every world rank's figures: the prefill pool's ranks, then
    /// the decode pool's.
    pub report: InferReport,
    /// Ranks of the prefill pool (world ranks `0..prefill_ranks`).
    pub prefill_ranks: usize,
    /// Per world rank, the KV bytes it received (fp32), decode ranks only.
    pub kv_received: Vec<f64>,
}

impl DisaggReport {
    /// KV bytes moved between the pools: all the prefill ranks sent on `kv`.
    pub fn kv_transfer_bytes(&self) -> f64 {
        self.report
            .counts
            .iter()
            .map(|c| c.axis_bytes_sent(KV_AXIS))
            .sum()
    }
}

/// The pools of a disaggregated plan, `(prefill, decode)`: `None` when the plan is
/// not one (no `serving` section, or an aggregated one); an error when it is but
/// carries no prefill plan.
pub fn pools(plan: &Plan) -> Result<Option<(&Plan, &Plan)>, String> {
    let Some(s) = plan
        .serving
        .as_ref()
        .filter(|s| s.mode == ServingMode::Disaggregated)
    else {
        return Ok(None);
    };
    let prefill = s.prefill_plan.as_deref().ok_or(
        "the plan's serving section is disaggregated but carries no prefill_plan (the prefill pool's programs); write it again with `meshplan deploy`",
    )?;
    Ok(Some((prefill, plan)))
}

/// The prefill pool of a disaggregated plan that carries one ([`pools`]).
pub fn prefill_pool(plan: &Plan) -> Option<&Plan> {
    pools(plan).ok().flatten().map(|(prefill, _)| prefill)
}

/// Checks a disaggregated run before any rank starts: both pools run these
/// requests, and the prefill pool's caches map onto the decode pool's.
pub fn check_disaggregated(plan: &Plan, opts: &InferOptions) -> Result<(), String> {
    checked(plan, opts).map(|_| ())
}

/// The plan's prefill and decode pools, checked against `opts`, and the route of
/// the KV cache between them.
fn checked<'p>(
    plan: &'p Plan,
    opts: &InferOptions,
) -> Result<(&'p Plan, &'p Plan, Vec<KvPiece>), String> {
    let (prefill, decode) = pools(plan)?.ok_or("the plan is not a disaggregated deployment")?;
    check_inputs(prefill, opts).map_err(|m| format!("the prefill pool: {m}"))?;
    check_inputs(decode, opts).map_err(|m| format!("the decode pool: {m}"))?;
    Ok((prefill, decode, kv_route(prefill, decode)?))
}

/// What both pools' ranks share.
struct Ctx<'a> {
    prefill: &'a Plan,
    decode: &'a Plan,
    route: Vec<KvPiece>,
    opts: &'a InferOptions,
    /// World rank of the decode pool's rank 0.
    base: usize,
}

impl Ctx<'_> {
    fn dp(plan: &Plan) -> usize {
        crate::program::mesh_place(plan, &[], "dp").size.max(1)
    }

    /// The world rank of `pos` in request `i`'s replica of the prefill or decode
    /// pool.
    fn world_rank(&self, decode: bool, i: usize, pos: PoolPos) -> Result<usize, RankError> {
        let (plan, base) = if decode {
            (self.decode, self.base)
        } else {
            (self.prefill, 0)
        };
        let replica = (i % Ctx::dp(plan)) as u64;
        pool_rank(plan, replica, pos)
            .map(|r| base + r)
            .ok_or_else(|| {
                fail(format!(
                    "no rank at stage {} tp {} of replica {replica}",
                    pos.stage, pos.tp
                ))
            })
    }
}

/// Runs a disaggregated plan's two pools as one world of CPU threads, fp32.
pub fn infer_disaggregated(plan: &Plan, opts: &InferOptions) -> Result<DisaggReport, ExecError> {
    infer_disaggregated_on(plan, opts, &|_| Ok(HostDevice))
}

/// Runs a disaggregated plan's two pools as one world of threads, world rank `r`
/// on the device `make(r)`.
pub fn infer_disaggregated_on<D: Device>(
    plan: &Plan,
    opts: &InferOptions,
    make: &(dyn Fn(usize) -> crate::device::DResult<D> + Sync),
) -> Result<DisaggReport, ExecError> {
    let (prefill, decode, route) = checked(plan, opts).map_err(ExecError::Plan)?;
    for pool in [prefill, decode] {
        check_weights(pool, opts)?;
    }
    let (np, nd) = (prefill.ranks.len(), decode.ranks.len());
    let ctx = Ctx {
        prefill,
        decode,
        route,
        opts,
        base: np,
    };
    let results = crate::comm::run_ranks(np + nd, opts.timeout, opts.threads_per_rank, |comm| {
        let is_prefill = comm.rank() < np;
        let (pool, base) = if is_prefill {
            (prefill, 0)
        } else {
            (decode, np)
        };
        let dev = make(comm.rank()).map_err(crate::device::derr("device"))?;
        let mut r = InferRank::new(dev, pool, D::host_comm(Box::new(comm)), opts, base)?;
        r.comm.barrier(&Group::world(np + nd))?;
        let t0 = Instant::now();
        let (outputs, received) = if is_prefill {
            (prefill_side(&mut r, &ctx, t0)?, 0.0)
        } else {
            decode_side(&mut r, &ctx, t0)?
        };
        Ok((r.finish(outputs, t0), received))
    });
    let (outs, kv_received): (Vec<_>, Vec<_>) = rank_outs(results)?.into_iter().unzip();
    let n = opts.requests.len();
    let first = recorded(&outs[..np], n)?;
    let rest = recorded(&outs[np..], n)?;
    let requests = first
        .into_iter()
        .zip(rest)
        .enumerate()
        .map(|(i, (a, b))| merged(i, a, b))
        .collect::<Result<_, _>>()?;
    Ok(DisaggReport {
        report: summarize(requests, outs)?,
        prefill_ranks: np,
        kv_received,
    })
}

/// Request `i`'s output: the prefill pool's first token, then the decode pool's.
fn merged(
    i: usize,
    first: Option<RequestOutput>,
    rest: Option<RequestOutput>,
) -> Result<RequestOutput, ExecError> {
    let missing = |pool: &str| ExecError::Output(format!("request {i} was not {pool} by any rank"));
    let mut o = first.ok_or_else(|| missing("prefilled"))?;
    let d = rest.ok_or_else(|| missing("decoded"))?;
    o.tokens.extend(d.tokens);
    o.step_logits.extend(d.step_logits);
    if !d.logits.is_empty() {
        o.logits = d.logits;
    }
    o.ended_at_eos |= d.ended_at_eos;
    o.tpot_s = d.tpot_s;
    Ok(o)
}

/// A prefill rank: prefill each request, sample its first token on the last stage,
/// send its cache (and the token) to the decode replica.
fn prefill_side<D: Device>(
    r: &mut InferRank<'_, D>,
    ctx: &Ctx<'_>,
    t0: Instant,
) -> Result<Vec<(usize, RequestOutput)>, RankError> {
    let record = r.records();
    let served = r.serve(|r, mine, p| {
        r.prefill_passes(mine, |r, j, i, done| {
            if let Some(l) = done.logits {
                let now = record.then(|| t0.elapsed());
                (p.take_tokens(&r.dev, (j, 0), &l, &ctx.opts.sampling, now))
                    .map_err(derr("sampling"))?;
            }
            send_cache(r, ctx, i, &done.cache)?;
            if record {
                for tp in 0..ctx.decode.strategy.tp {
                    let pos = PoolPos {
                        tp,
                        ..recorder(ctx.decode)
                    };
                    let to = ctx.world_rank(true, i, pos)?;
                    r.comm.send(to, TOKEN_AXIS, &[p.current[j] as f32])?;
                }
            }
            Ok(())
        })
    })?;
    Ok(served.0)
}

/// Sends this rank's pieces of request `i`'s cache to its decode replica: one
/// message a piece, the head's keys then its values.
fn send_cache<D: Device>(
    r: &mut InferRank<'_, D>,
    ctx: &Ctx<'_>,
    i: usize,
    cache: &RequestCache<D::Act>,
) -> Result<(), RankError> {
    let me = PoolPos {
        stage: r.at.stage,
        tp: r.tp.rank as u64,
    };
    let len = ctx.opts.requests[i].len();
    let e = derr("KV cache");
    for piece in ctx.route.iter().filter(|p| p.from == me) {
        let (k, v) = cache.get(&piece.layer).ok_or_else(|| {
            fail(format!(
                "request {i}: layer {} is not in this rank's KV cache",
                piece.layer
            ))
        })?;
        let (d, dv) = (piece.qk_dim as usize, piece.v_dim as usize);
        let (nk, nv) = (D::act_len(k), D::act_len(v));
        let heads = nk / (len * d).max(1);
        let h = piece.from_index as usize;
        if h >= heads || nk != len * heads * d || nv != len * heads * dv {
            return Err(fail(format!(
                "layer {}: a cache of {nk} keys and {nv} values does not hold head {h} of {len} positions",
                piece.layer
            )));
        }
        // Rows of the cache `[len, heads, d]` are (position, head).
        let rows: Vec<u32> = (0..len).map(|pos| (pos * heads + h) as u32).collect();
        let rows = r.dev.ids_upload(&rows).map_err(&e)?;
        let mut buf = r.dev.act_zeros(len * d).map_err(&e)?;
        r.dev.gather_rows(k, &rows, d, &mut buf).map_err(&e)?;
        let mut values = r.dev.act_zeros(len * dv).map_err(&e)?;
        r.dev.gather_rows(v, &rows, dv, &mut values).map_err(&e)?;
        r.dev
            .act_append(&mut buf, &values, (0, len * dv))
            .map_err(&e)?;
        let to = ctx.world_rank(true, i, piece.to)?;
        r.comm
            .send_act(&r.dev, (to, KV_AXIS), &buf, (0, len * (d + dv)))?;
    }
    Ok(())
}

/// A decode rank: receive each request's cache (and, on the last stage, its first
/// token), then decode them together. Also returns the KV bytes received.
fn decode_side<D: Device>(
    r: &mut InferRank<'_, D>,
    ctx: &Ctx<'_>,
    t0: Instant,
) -> Result<(Vec<(usize, RequestOutput)>, f64), RankError> {
    let record = r.records();
    r.serve(|r, mine, p| {
        let mut received = 0.0;
        for (j, &i) in mine.iter().enumerate() {
            let (cache, bytes) = recv_cache(r, ctx, i)?;
            received += bytes;
            r.put_cache(j, cache);
            if r.at.stage == r.at.last_stage {
                let from = ctx.world_rank(false, i, recorder(ctx.prefill))?;
                let mut t = [0.0f32];
                r.comm.recv(from, TOKEN_AXIS, &mut t)?;
                p.handed_token(j, t[0] as u32, record.then(|| t0.elapsed()));
            }
        }
        r.decode_passes(mine, p, t0)?;
        Ok(received)
    })
}

/// The rank of a pool replica that samples and records: last stage, tensor rank 0.
fn recorder(plan: &Plan) -> PoolPos {
    PoolPos {
        stage: plan.programs.iter().map(|p| p.stage).max().unwrap_or(0),
        tp: 0,
    }
}

/// Receives this rank's pieces of request `i`'s cache, laid out as a prefill on
/// this rank would have left them; with the bytes received. Each layer's heads
/// arrive as `[heads, len, d]` blocks and one gather per layer lays them out as
/// the cache's `[len, heads, d]`.
fn recv_cache<D: Device>(
    r: &mut InferRank<'_, D>,
    ctx: &Ctx<'_>,
    i: usize,
) -> Result<(RequestCache<D::Act>, f64), RankError> {
    let me = PoolPos {
        stage: r.at.stage,
        tp: r.tp.rank as u64,
    };
    let len = ctx.opts.requests[i].len();
    let e = derr("KV cache");
    let mut blocks: RequestCache<D::Act> = RequestCache::new();
    let mut shapes = std::collections::BTreeMap::new();
    let mut bytes = 0.0;
    for piece in ctx.route.iter().filter(|p| p.to == me) {
        let (d, dv) = (piece.qk_dim as usize, piece.v_dim as usize);
        let heads = piece.to_heads as usize;
        let h = piece.to_index as usize;
        let mut buf = r.dev.act_zeros(len * (d + dv)).map_err(&e)?;
        let from = ctx.world_rank(false, i, piece.from)?;
        r.comm.recv_act(&r.dev, (from, KV_AXIS), &mut buf)?;
        bytes += ctx.decode.model.dtype.size_bytes() as f64 * (len * (d + dv)) as f64;
        let (k, v) = match blocks.entry(piece.layer) {
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::btree_map::Entry::Vacant(slot) => {
                shapes.insert(piece.layer, (heads, d, dv));
                let k = r.dev.act_zeros(heads * len * d).map_err(&e)?;
                slot.insert((k, r.dev.act_zeros(heads * len * dv).map_err(&e)?))
            }
        };
        r.dev
            .act_copy((&buf, 0), (k, h * len * d), len * d)
            .map_err(&e)?;
        r.dev
            .act_copy((&buf, len * d), (v, h * len * dv), len * dv)
            .map_err(&e)?;
    }
    let mut cache = RequestCache::new();
    for (layer, (kb, vb)) in blocks {
        let (heads, d, dv) = shapes[&layer];
        // Cache row (position, head) is block row (head, position).
        let rows: Vec<u32> = (0..len * heads)
            .map(|row| ((row % heads) * len + row / heads) as u32)
            .collect();
        let rows = r.dev.ids_upload(&rows).map_err(&e)?;
        let mut k = r.dev.act_zeros(len * heads * d).map_err(&e)?;
        r.dev.gather_rows(&kb, &rows, d, &mut k).map_err(&e)?;
        let mut v = r.dev.act_zeros(len * heads * dv).map_err(&e)?;
        r.dev.gather_rows(&vb, &rows, dv, &mut v).map_err(&e)?;
        cache.insert(layer, (k, v));
    }
    Ok((cache, bytes))
}

/// Every rank's difference from the plan's bytes: each pool's own collectives, the
/// KV bytes each prefill rank sends and each decode rank receives
/// ([`kv_transfer_bytes`] at the model's dtype, per request at its prompt length),
/// and the first tokens (4 bytes to each rank of the decode replica's last stage,
/// from the prefill replica's recording rank). `None` when the run does not have
/// the plan's shapes (prompts of the plan's `prompt_len`, each decode replica the
/// plan's batch), as for an ordinary run.
pub fn byte_mismatches(
    plan: &Plan,
    opts: &InferOptions,
    run: &DisaggReport,
) -> Option<Vec<String>> {
    let (prefill, decode) = pools(plan).ok()??;
    let mut out = pool_bytes(prefill, run, true).mismatches(opts)?;
    out.extend(pool_bytes(decode, run, false).mismatches(opts)?);
    out.extend(kv_mismatches(prefill, decode, opts, run).ok()?);
    Some(out)
}

/// One pool's ranks of the run (`first`: the prefill pool).
fn pool_bytes<'a>(plan: &'a Plan, run: &'a DisaggReport, first: bool) -> PoolBytes<'a> {
    let np = run.prefill_ranks;
    let r = &run.report;
    let (name, ranks) = if first {
        ("prefill pool ", 0..np)
    } else {
        ("decode pool ", np..r.counts.len())
    };
    PoolBytes {
        plan,
        counts: &r.counts[ranks.clone()],
        routed_ep: &r.routed_ep_bytes[ranks.clone()],
        prefill: first,
        decode: !first,
        name,
        base: ranks.start,
    }
}

/// The KV move's and the first tokens' differences from [`kv_transfer_bytes`].
fn kv_mismatches(
    prefill: &Plan,
    decode: &Plan,
    opts: &InferOptions,
    run: &DisaggReport,
) -> Result<Vec<String>, String> {
    let elem = decode.model.dtype.size_bytes() as f64;
    // A first token travels as one element of the prefill pool's counts.
    let token = prefill.model.dtype.size_bytes() as f64;
    let (np, counts) = (run.prefill_ranks, &run.report.counts);
    let (dp_p, dp_d) = (Ctx::dp(prefill), Ctx::dp(decode));
    let (mut sent, mut received) = (vec![0.0; np], vec![0.0; decode.ranks.len()]);
    let mut tokens = vec![0.0; np];
    for (i, req) in opts.requests.iter().enumerate() {
        let b = kv_transfer_bytes(prefill, decode, req.len() as u64, elem)?;
        for (r, s) in sent.iter_mut().enumerate() {
            let (replica, pos) = pool_pos(prefill, r).ok_or("a prefill rank has no program")?;
            if replica as usize == i % dp_p {
                *s += b.sent[r];
                if pos == recorder(prefill) {
                    tokens[r] += token * decode.strategy.tp as f64;
                }
            }
        }
        for (r, g) in received.iter_mut().enumerate() {
            let (replica, _) = pool_pos(decode, r).ok_or("a decode rank has no program")?;
            if replica as usize == i % dp_d {
                *g += b.received[r];
            }
        }
    }
    let mut out = Vec::new();
    let mut compare = |what: &str, rank: usize, got: f64, want: f64| {
        out.extend(byte_gap(format!("rank {rank} {what}"), got, want));
    };
    for (rank, c) in counts.iter().enumerate() {
        let (kv, tok) = match rank.checked_sub(np) {
            None => (sent[rank], tokens[rank]),
            Some(_) => (0.0, 0.0),
        };
        compare("kv sent", rank, c.axis_bytes_sent(KV_AXIS), kv);
        compare(
            "first tokens sent",
            rank,
            c.axis_bytes_sent(TOKEN_AXIS),
            tok,
        );
        if let Some(d) = rank.checked_sub(np) {
            let got = run.kv_received.get(rank).copied().unwrap_or(0.0);
            compare("kv received", rank, got, received[d]);
        }
    }
    Ok(out)
}
