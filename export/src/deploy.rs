//! A serving deployment (`meshplan deploy`'s plan, with a `serving` section) as
//! SGLang or vLLM launch commands: every server of every pool, on its node and
//! GPUs, and the router in front of them.
//!
//! Each pool goes through its framework's per-plan exporter with the pool's own
//! plan (the decode pool's, or the whole aggregated deployment's, is the plan
//! itself; the prefill pool's is `serving.prefill_plan`), so a pool's servers,
//! widths, request limits and refusals are those a plain plan of its strategy
//! gets. This module adds what the deployment chose beyond that: the prefill chunk,
//! the prefill and decode roles, how the KV cache moves between them, the longest
//! request the length distributions allow, and where each server runs.
//!
//! Placement follows the plan's ranks: the prefill pool's servers first, then the
//! decode pool's, in GPU order; a server that fits in a node starts on the next
//! node rather than straddle two. The plan records each pool's share of the
//! cluster, not the cluster, so the node is the whole deployment when the KV cache
//! moves over NVLink (both pools in one node) and otherwise the widest pool's node.

use crate::{sglang, vllm, CannotExpress, Launch, Refusals, Target};
use meshplan_ir::plan::Plan;
use meshplan_ir::serving::{LenDist, PoolInfo, ServingInfo, ServingMode};
use meshplan_ir::Workload;
use std::collections::BTreeMap;

/// The first server's HTTP port on each node.
const HTTP_PORT: u64 = 30000;
/// Between servers on one node: SGLang takes a few ports above `--port` and above
/// the `--dist-init-addr` port for DP-attention and multi-node servers.
const PORT_STEP: u64 = 100;
/// The first multi-node server's `--dist-init-addr` port on each node.
const DIST_INIT_PORT: u64 = 20000;
/// SGLang's default `--disaggregation-bootstrap-port`, then one more per prefill
/// server on the node.
const BOOTSTRAP_PORT: u64 = 8998;
/// vLLM's default `VLLM_NIXL_SIDE_CHANNEL_PORT`; each data-parallel engine of a
/// server takes the next one.
const NIXL_SIDE_CHANNEL_PORT: u64 = 5600;
/// The router's port, where clients send requests.
const ROUTER_PORT: u64 = 8000;
/// vLLM's KV connector for prefill and decode servers alike (NIXL pulls the cache
/// from the prefill server: NVLink in a node, RDMA across nodes).
const VLLM_KV_TRANSFER_CONFIG: &str = r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#;

/// What a pool's servers do.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Both phases (continuous batching with chunked prefill).
    Aggregated,
    /// Prompts only; the KV cache goes to a decode server.
    Prefill,
    /// Generation from a prefill server's KV cache.
    Decode,
}

impl Role {
    /// How refusals and comments name the pool.
    fn pool(self) -> &'static str {
        match self {
            Role::Aggregated => "the instances",
            Role::Prefill => "prefill pool",
            Role::Decode => "decode pool",
        }
    }

    fn server(self) -> &'static str {
        match self {
            Role::Aggregated => "server",
            Role::Prefill => "prefill server",
            Role::Decode => "decode server",
        }
    }
}

/// One pool and its servers as the per-plan exporter derived them.
struct Pool<'a> {
    role: Role,
    info: &'a PoolInfo,
    launch: Launch,
}

/// Where one server runs.
struct Placed {
    /// Its first node.
    node: u64,
    /// Its first GPU on that node.
    gpu: u64,
    /// Its HTTP port (on its first node).
    port: u64,
    /// The server's turn among the servers starting on its node.
    slot: u64,
    /// Prefill servers before it on its node (its bootstrap port).
    prefill_slot: u64,
    /// Data-parallel engines of earlier servers on its node (vLLM's NIXL ports).
    engines_before: u64,
}

/// The launch commands of a plan with a `serving` section, for SGLang or vLLM.
pub(crate) fn export(plan: &Plan, target: Target) -> Result<String, CannotExpress> {
    let Some(s) = plan.serving.as_ref() else {
        unreachable!("only plans with a serving section come here")
    };
    let mut r = Refusals::new(target);
    let mut wanted: Vec<(Role, &PoolInfo, &Plan)> = Vec::new();
    match s.mode {
        ServingMode::Aggregated => wanted.push((Role::Aggregated, &s.decode, plan)),
        ServingMode::Disaggregated => {
            match (&s.prefill, &s.prefill_plan) {
                (Some(info), Some(p)) => wanted.push((Role::Prefill, info, p)),
                _ => r.push(
                    "the deployment is disaggregated but the plan lacks its prefill pool (`serving.prefill` and `serving.prefill_plan`); re-run meshplan deploy",
                ),
            }
            wanted.push((Role::Decode, &s.decode, plan));
        }
    }
    let context = longest_request(&plan.workload);
    let mut pools = Vec::new();
    for (role, info, p) in wanted {
        let launch = match target {
            Target::Sglang => sglang::launch(p, context),
            _ => vllm::launch(p, context, vllm_replicas(p, info)),
        };
        match launch {
            Ok(launch) => {
                if let Some(why) = serving_refusal(target, role, info, &launch) {
                    r.push(format!("{}: {why}", role.pool()));
                }
                pools.push(Pool { role, info, launch });
            }
            Err(e) => {
                for why in e.reasons {
                    r.push(format!("{}: {why}", role.pool()));
                }
            }
        }
    }
    r.check()?;
    Ok(render(plan, s, target, &pools))
}

/// Data-parallel engines per `vllm serve`: the whole pool while it fits on a node
/// (one server, like a plain plan), else one instance each (vLLM's data
/// parallelism across nodes needs launches per node of their own).
fn vllm_replicas(p: &Plan, info: &PoolInfo) -> u64 {
    let c = &p.strategy;
    let inst = info.strategy.dp.max(1);
    if c.dp * c.tp * c.pp <= p.cluster.gpus_per_node || !c.dp.is_multiple_of(inst) {
        c.dp
    } else {
        inst
    }
}

/// What the framework cannot take of a pool's serving knobs.
fn serving_refusal(target: Target, role: Role, info: &PoolInfo, l: &Launch) -> Option<String> {
    let chunk = chunk(role, info)?;
    if target != Target::Vllm {
        return None;
    }
    let seqs: u64 = l.args.value("--max-num-seqs")?.parse().ok()?;
    (chunk < seqs).then(|| {
        format!(
            "vLLM needs --max-num-batched-tokens (the prefill chunk, {chunk} tokens) to be at least --max-num-seqs ({seqs} requests per engine); re-deploy with workload.serving.chunked_prefill of {seqs} tokens or more"
        )
    })
}

/// The tokens a pool's server prefills per iteration: the deployment's chunk
/// (aggregated) or the whole prompt it priced (prefill pool); decode servers
/// prefill nothing.
fn chunk(role: Role, info: &PoolInfo) -> Option<u64> {
    (role != Role::Decode && info.chunked_prefill > 0).then_some(info.chunked_prefill)
}

/// The longest request a server must accept: the longest prompt and output of the
/// workload's length distributions, where it has them (the plan's `prompt_len` and
/// `output_len` are their means).
fn longest_request(w: &Workload) -> u64 {
    match w {
        Workload::Inference {
            prompt_len,
            output_len,
            serving,
            ..
        } => {
            let longest = |d: Option<&LenDist>, mean: u64| {
                d.map_or(mean, |d| d.quantile(1.0).ceil() as u64).max(mean)
            };
            let sp = serving.as_ref();
            longest(sp.and_then(|s| s.prompt.as_ref()), *prompt_len)
                + longest(sp.and_then(|s| s.output.as_ref()), *output_len)
        }
        Workload::Train { seq_len, .. } => *seq_len,
    }
}

/// Places every server, prefill pool first, in GPU order; also the nodes used.
fn place(pools: &[Pool], node_gpus: u64) -> (Vec<Vec<Placed>>, u64) {
    #[derive(Default)]
    struct Node {
        servers: u64,
        prefill: u64,
        engines: u64,
    }
    let mut nodes: BTreeMap<u64, Node> = BTreeMap::new();
    let mut cursor = 0u64;
    let mut out = Vec::new();
    for p in pools {
        let l = &p.launch;
        let mut placed = Vec::new();
        for _ in 0..l.servers {
            let spans = l.nodes > 1;
            if spans || cursor % node_gpus + l.gpus > node_gpus {
                cursor = cursor.div_ceil(node_gpus) * node_gpus;
            }
            let node = cursor / node_gpus;
            let gpu = cursor % node_gpus;
            cursor += if spans { l.nodes * node_gpus } else { l.gpus };
            let n = nodes.entry(node).or_default();
            placed.push(Placed {
                node,
                gpu,
                port: HTTP_PORT + PORT_STEP * n.servers,
                slot: n.servers,
                prefill_slot: n.prefill,
                engines_before: n.engines,
            });
            n.servers += 1;
            n.engines += l.replicas;
            if p.role == Role::Prefill {
                n.prefill += 1;
            }
        }
        out.push(placed);
    }
    (out, cursor.div_ceil(node_gpus))
}

/// The launch script: lines of `#` comments and commands.
#[derive(Default)]
struct Script(Vec<String>);

impl Script {
    fn comment(&mut self, c: impl AsRef<str>) {
        self.0.push(format!("# {}", c.as_ref()));
    }

    fn command(&mut self, words: &[String]) {
        self.0.push(words.join(" "));
    }

    fn finish(self) -> String {
        let mut s = self.0.join("\n");
        s.push('\n');
        s
    }
}

/// How the deployment's KV cache moves, as the target spells it.
struct Transfer {
    /// Both pools in one node (the plan priced NVLink).
    one_node: bool,
}

impl Transfer {
    /// SGLang's `--disaggregation-transfer-backend`: NIXL (UCX over NVLink) in a
    /// node, Mooncake (SGLang's default, RDMA) across nodes.
    fn sglang_backend(&self) -> &'static str {
        if self.one_node {
            "nixl"
        } else {
            "mooncake"
        }
    }
}

fn render(plan: &Plan, s: &ServingInfo, target: Target, pools: &[Pool]) -> String {
    let transfer = Transfer {
        one_node: s.kv_transfer.as_ref().is_some_and(|k| k.link == "nvlink"),
    };
    let gpus: u64 = pools.iter().map(|p| p.launch.servers * p.launch.gpus).sum();
    let node_gpus = if transfer.one_node {
        gpus
    } else {
        plan.cluster.gpus_per_node.max(
            s.prefill_plan
                .as_ref()
                .map_or(0, |p| p.cluster.gpus_per_node),
        )
    }
    .max(1);
    let (places, used_nodes) = place(pools, node_gpus);
    let mut out = Script::default();
    header(
        &mut out, plan, s, target, pools, &transfer, gpus, used_nodes,
    );

    let mut prefill_urls = Vec::new();
    let mut urls = Vec::new();
    for (p, placed) in pools.iter().zip(&places) {
        let l = &p.launch;
        let inside = ["--dp-size", "--attn-dp-size", "--data-parallel-size"]
            .into_iter()
            .find_map(|f| l.args.value(f).map(|v| format!(" ({f} {v})")))
            .unwrap_or_default();
        out.comment(format!(
            "{}: {} as {} of {}{inside}",
            match p.role {
                Role::Aggregated => "deployment",
                r => r.pool(),
            },
            plural(p.info.instances, "instance"),
            plural(l.servers, "server"),
            plural(l.gpus, "GPU"),
        ));
        for (i, pl) in placed.iter().enumerate() {
            let which = format!("{} {} of {}", p.role.server(), i + 1, l.servers);
            match target {
                Target::Sglang => sglang_server(&mut out, p, pl, &which, &transfer),
                _ => vllm_server(&mut out, p, pl, &which),
            }
            let url = format!("http://NODE{}:{}", pl.node, pl.port);
            match p.role {
                Role::Prefill => prefill_urls.push((url, BOOTSTRAP_PORT + pl.prefill_slot)),
                _ => urls.push(url),
            }
        }
    }
    router(&mut out, target, s.mode, &prefill_urls, &urls);
    out.finish()
}

/// The comments above the commands: the deployment, its prediction, how the KV
/// cache moves, and how to run the lines.
#[allow(clippy::too_many_arguments)]
fn header(
    out: &mut Script,
    plan: &Plan,
    s: &ServingInfo,
    target: Target,
    pools: &[Pool],
    transfer: &Transfer,
    gpus: u64,
    used_nodes: u64,
) {
    let disaggregated = s.mode == ServingMode::Disaggregated;
    let pool_words: Vec<String> = pools
        .iter()
        .map(|p| {
            let (label, what) = match p.role {
                Role::Aggregated => (
                    "",
                    format!(
                        "{} in flight each, prefill chunks of {} tokens",
                        plural(p.info.concurrency, "request"),
                        p.info.chunked_prefill
                    ),
                ),
                Role::Prefill => (
                    "prefill ",
                    format!(
                        "{} at a time each, prefill chunks of {} tokens (the mean prompt, whole)",
                        plural(p.info.concurrency, "request"),
                        p.info.chunked_prefill
                    ),
                ),
                Role::Decode => (
                    "decode ",
                    format!("{} in flight each", plural(p.info.concurrency, "request")),
                ),
            };
            format!(
                "{label}{} x [{}] ({} each, {what})",
                p.info.instances,
                p.info.strategy,
                plural(p.info.gpus_per_instance, "GPU"),
            )
        })
        .collect();
    out.comment(format!(
        "meshplan export --to {target}: {} served {} on {gpus} {} GPUs of {}: {}",
        plan.model.name,
        if disaggregated {
            "disaggregated"
        } else {
            "aggregated"
        },
        plan.cluster.gpu,
        plan.cluster.name,
        pool_words.join("; ")
    ));
    let num = |k: &str| s.predicted.get(k).and_then(|v| v.as_f64());
    if let (Some(ttft), Some(tpot), Some(per_gpu), Some(per_user)) = (
        num("ttft_s"),
        num("tpot_s"),
        num("output_tokens_per_s_per_gpu"),
        num("output_tokens_per_s_per_user"),
    ) {
        out.comment(format!(
            "predicted: TTFT {:.1} ms, TPOT {:.2} ms, {per_gpu:.1} output tokens/s per GPU, {per_user:.1} per user",
            ttft * 1e3,
            tpot * 1e3
        ));
    }
    if let Some(k) = &s.kv_transfer {
        let how = match target {
            Target::Sglang if transfer.one_node => "NIXL",
            Target::Sglang => "Mooncake",
            _ => "vLLM's NixlConnector",
        };
        out.comment(format!(
            "each request's KV cache ({:.1} MiB) moves from its prefill to its decode server over {} in a predicted {:.2} ms, with {how}",
            k.bytes_per_request / (1u64 << 20) as f64,
            k.link,
            k.time_s * 1e3
        ));
    }
    out.comment(format!(
        "one command per server{}, run on the node named above it ({}); MODEL is the model's path or name, NODEi node i's address{}",
        if target == Target::Sglang {
            " (and per node of a server over several nodes)"
        } else {
            ""
        },
        if used_nodes == 1 {
            "node 0: every server on one node".to_string()
        } else {
            format!("nodes 0-{}", used_nodes - 1)
        },
        if pools.iter().any(|p| p.launch.servers > 1) || disaggregated {
            "; start the router last"
        } else {
            ""
        }
    ));
}

/// One SGLang server: the pool's options, its role, its port and first GPU; a line
/// per node of a server over several nodes.
fn sglang_server(out: &mut Script, p: &Pool, pl: &Placed, which: &str, transfer: &Transfer) {
    let l = &p.launch;
    let mut words: Vec<String> = [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "MODEL",
    ]
    .map(String::from)
    .into();
    words.extend(l.args.words());
    if let Some(c) = chunk(p.role, p.info) {
        words.extend(["--chunked-prefill-size".into(), c.to_string()]);
    }
    if p.info.dcp > 1 {
        words.extend(["--dcp-size".into(), p.info.dcp.to_string()]);
    }
    let mode = match p.role {
        Role::Aggregated => None,
        Role::Prefill => Some("prefill"),
        Role::Decode => Some("decode"),
    };
    if let Some(mode) = mode {
        words.extend([
            "--disaggregation-mode".into(),
            mode.into(),
            "--disaggregation-transfer-backend".into(),
            transfer.sglang_backend().into(),
        ]);
    }
    if p.role == Role::Prefill {
        words.extend([
            "--disaggregation-bootstrap-port".into(),
            (BOOTSTRAP_PORT + pl.prefill_slot).to_string(),
        ]);
    }
    words.extend([
        "--host".into(),
        "0.0.0.0".into(),
        "--port".into(),
        pl.port.to_string(),
        "--base-gpu-id".into(),
        pl.gpu.to_string(),
    ]);
    if l.nodes == 1 {
        out.comment(format!(
            "node {}, {}: {which}",
            pl.node,
            gpu_range(pl.gpu, l.gpus)
        ));
        out.command(&words);
        return;
    }
    let addr = format!("NODE{}:{}", pl.node, DIST_INIT_PORT + PORT_STEP * pl.slot);
    for rank in 0..l.nodes {
        out.comment(format!(
            "node {}, every GPU: {which}, its node {rank} of {}",
            pl.node + rank,
            l.nodes
        ));
        let mut w = words.clone();
        w.extend([
            "--node-rank".into(),
            rank.to_string(),
            "--dist-init-addr".into(),
            addr.clone(),
        ]);
        out.command(&w);
    }
}

/// One `vllm serve`: its GPUs and NIXL side channel in the environment, the
/// pool's options, the prefill chunk, the KV connector and its port.
fn vllm_server(out: &mut Script, p: &Pool, pl: &Placed, which: &str) {
    let l = &p.launch;
    let mut words = Vec::new();
    if l.nodes == 1 {
        let ids: Vec<String> = (pl.gpu..pl.gpu + l.gpus).map(|g| g.to_string()).collect();
        words.push(format!("CUDA_VISIBLE_DEVICES={}", ids.join(",")));
    }
    if p.role != Role::Aggregated {
        words.push(format!("VLLM_NIXL_SIDE_CHANNEL_HOST=NODE{}", pl.node));
        words.push(format!(
            "VLLM_NIXL_SIDE_CHANNEL_PORT={}",
            NIXL_SIDE_CHANNEL_PORT + pl.engines_before
        ));
    }
    words.extend(["vllm".into(), "serve".into(), "MODEL".into()]);
    words.extend(l.args.words());
    if let Some(c) = chunk(p.role, p.info) {
        words.extend([
            "--max-num-batched-tokens".into(),
            c.to_string(),
            "--enable-chunked-prefill".into(),
        ]);
    }
    if p.info.dcp > 1 {
        words.extend([
            "--decode-context-parallel-size".into(),
            p.info.dcp.to_string(),
        ]);
    }
    if p.role != Role::Aggregated {
        words.extend([
            "--kv-transfer-config".into(),
            crate::shell_word(VLLM_KV_TRANSFER_CONFIG),
        ]);
    }
    words.extend(["--port".into(), pl.port.to_string()]);
    if l.nodes == 1 {
        out.comment(format!(
            "node {}, {}: {which}",
            pl.node,
            gpu_range(pl.gpu, l.gpus)
        ));
    } else {
        out.comment(format!(
            "nodes {}-{}: {which}; vLLM runs a server over several nodes on a Ray cluster of them: start one there (ray start) and run this on node {}",
            pl.node,
            pl.node + l.nodes - 1,
            pl.node
        ));
    }
    out.command(&words);
}

/// The router in front: each request prefilled on a prefill server and decoded on a
/// decode server, or the aggregated servers balanced; one aggregated server takes
/// requests itself. `prefill` has each prefill server's bootstrap port.
fn router(
    out: &mut Script,
    target: Target,
    mode: ServingMode,
    prefill: &[(String, u64)],
    others: &[String],
) {
    let mut words: Vec<String> = match target {
        Target::Sglang => ["python", "-m", "sglang_router.launch_router"]
            .map(String::from)
            .into(),
        _ => vec!["vllm-router".into()],
    };
    let what = if mode == ServingMode::Disaggregated {
        words.push(match target {
            Target::Sglang => "--pd-disaggregation".into(),
            _ => "--vllm-pd-disaggregation".into(),
        });
        for (url, bootstrap) in prefill {
            words.extend(["--prefill".into(), url.clone()]);
            if target == Target::Sglang {
                words.push(bootstrap.to_string());
            }
        }
        for url in others {
            words.extend(["--decode".into(), url.clone()]);
        }
        if target == Target::Vllm {
            words.extend(["--kv-connector".into(), "nixl".into()]);
        }
        "each request prefilled on a prefill server, decoded on a decode server"
    } else if others.len() > 1 {
        words.push("--worker-urls".into());
        words.extend(others.iter().cloned());
        "requests balanced over the servers"
    } else {
        out.comment(format!(
            "clients send requests to {} (one server: no router)",
            others.first().map_or("", String::as_str)
        ));
        return;
    };
    words.extend([
        "--host".into(),
        "0.0.0.0".into(),
        "--port".into(),
        ROUTER_PORT.to_string(),
    ]);
    out.comment(format!(
        "router (any host that reaches the servers; clients send requests to its port {ROUTER_PORT}): {what}"
    ));
    out.command(&words);
}

/// `n` things, with the plural's s.
fn plural(n: u64, thing: &str) -> String {
    format!("{n} {thing}{}", if n == 1 { "" } else { "s" })
}

fn gpu_range(first: u64, n: u64) -> String {
    if n == 1 {
        format!("GPU {first}")
    } else {
        format!("GPUs {first}-{}", first + n - 1)
    }
}
