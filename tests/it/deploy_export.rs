//! `meshplan export` of a serving deployment (`meshplan deploy`'s plan): the launch
//! commands of every server of every pool, through the command line, checked
//! against the plan's `serving` section: each pool's parallel degrees, requests in
//! flight and prefill chunk, the prefill and decode roles and the KV connector,
//! GPUs and ports that do not collide, and the router in front. Plans without
//! `serving` keep their exports (tests/it/export.rs, byte for byte).

use crate::bin::{meshplan, temp_dir, ROOT};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

const LLAMA: &str = "models/llama3-70b-inference.yaml";
const H200: &str = "topologies/h200-node.yaml";
const MIXTRAL: &str = "models/mixtral-8x7b.yaml";
const INFERENCE: &str = "tests/python/exports/inference-workload.yaml";

/// A serving workload for `--workload`: Llama's own, with `serving` mapping lines.
fn workload(name: &str, serving: &str) -> PathBuf {
    let path = temp_dir("deploy-export").join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!(
            "kind: inference\nprompt_len: 2048\noutput_len: 256\nconcurrency: 64\nslo: {{ttft_ms: 2000, tpot_ms: 50}}\n{serving}"
        ),
    )
    .expect("workload file");
    path
}

/// `meshplan deploy ARGS -o NAME.json`: the plan's path and JSON.
#[track_caller]
fn deploy(name: &str, args: &[&str]) -> (String, Value) {
    let path = temp_dir("deploy-export").join(format!("{name}.json"));
    let path_s = path.display().to_string();
    let mut all = vec!["-q", "deploy"];
    all.extend_from_slice(args);
    all.extend(["-o", path_s.as_str()]);
    meshplan(&all).expect_code(0);
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("plan")).expect("json");
    assert!(v["serving"].is_object(), "{name}: no serving section");
    (path_s, v)
}

#[track_caller]
fn export(plan: &str, target: &str) -> String {
    let r = meshplan(&["export", plan, "--to", target]);
    r.expect_code(0);
    assert!(r.stderr.is_empty(), "{}: stderr {}", r.args, r.stderr);
    r.stdout
}

/// One command of an export: the comment above it, its environment assignments and
/// its words, and its options (`--flag` -> the words up to the next option).
struct Command {
    above: String,
    env: BTreeMap<String, String>,
    words: Vec<String>,
}

impl Command {
    fn opts(&self) -> BTreeMap<&str, Vec<&str>> {
        let mut out: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        let mut cur: Option<&str> = None;
        for w in &self.words {
            if w.starts_with("--") {
                out.entry(w.as_str()).or_default();
                cur = Some(w.as_str());
            } else if let Some(c) = cur {
                out.get_mut(c).expect("the option").push(w.as_str());
            }
        }
        out
    }

    #[track_caller]
    fn opt(&self, name: &str) -> Option<String> {
        self.opts().get(name).map(|v| v.join(" "))
    }

    #[track_caller]
    fn num(&self, name: &str) -> u64 {
        let v = self
            .opt(name)
            .unwrap_or_else(|| panic!("no {name} in {:?}", self.words));
        v.parse()
            .unwrap_or_else(|_| panic!("{name} {v} is not a number"))
    }

    fn has(&self, name: &str) -> bool {
        self.words.iter().any(|w| w == name)
    }
}

/// The commands of an export (split as a shell would: single quotes kept together).
fn commands(text: &str) -> Vec<Command> {
    let mut out = Vec::new();
    let mut above = String::new();
    for line in text.lines() {
        if let Some(c) = line.strip_prefix("# ") {
            above = c.to_string();
            continue;
        }
        assert!(!line.trim().is_empty(), "blank line in\n{text}");
        let mut words = shell_split(line);
        let mut env = BTreeMap::new();
        while let Some((k, v)) = words.first().and_then(|w| w.split_once('=')) {
            if !k.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
                break;
            }
            env.insert(k.to_string(), v.to_string());
            words.remove(0);
        }
        out.push(Command {
            above: above.clone(),
            env,
            words,
        });
    }
    out
}

fn shell_split(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for ch in line.chars() {
        match ch {
            '\'' => quoted = !quoted,
            ' ' if !quoted => {
                if !cur.is_empty() {
                    words.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    assert!(!quoted, "unbalanced quote: {line}");
    if !cur.is_empty() {
        words.push(cur);
    }
    words
}

fn servers<'a>(cmds: &'a [Command], target: &str) -> Vec<&'a Command> {
    cmds.iter()
        .filter(|c| match target {
            "sglang" => {
                c.words
                    .starts_with(&["python".into(), "-m".into(), "sglang.launch_server".into()])
            }
            _ => c.words.starts_with(&["vllm".into(), "serve".into()]),
        })
        .collect()
}

fn routers<'a>(cmds: &'a [Command], target: &str) -> Vec<&'a Command> {
    cmds.iter()
        .filter(|c| match target {
            "sglang" => c
                .words
                .get(2)
                .is_some_and(|w| w == "sglang_router.launch_router"),
            _ => c.words.first().is_some_and(|w| w == "vllm-router"),
        })
        .collect()
}

/// The servers of one role: their `--disaggregation-mode` (SGLang) or the pool
/// their comment names.
fn of_role<'a>(servers: &[&'a Command], target: &str, role: &str) -> Vec<&'a Command> {
    servers
        .iter()
        .copied()
        .filter(|c| match target {
            "sglang" => c.opt("--disaggregation-mode").unwrap_or_default() == role,
            _ => c.above.contains(&format!("{role} server")),
        })
        .collect()
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("{v} is not a count"))
}

/// The option names a framework defines (tests/data/frameworks), for SGLang's
/// server flags and vLLM's engine flags.
fn defined(target: &str) -> BTreeSet<String> {
    let path = PathBuf::from(ROOT).join(format!("tests/data/frameworks/{target}_options.txt"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .skip(1)
        .map(str::to_string)
        .collect()
}

/// Every server of `pool` (a dense model's `serving` pool) has the pool's degrees,
/// requests in flight and prefill chunk; `servers` start every instance once.
#[track_caller]
fn check_pool(target: &str, pool: &Value, servers: &[&Command], chunk: Option<u64>) {
    let s = &pool["strategy"];
    let (tp, pp, inst) = (u(&s["tp"]), u(&s["pp"]), u(&pool["instances"]));
    let concurrency = u(&pool["concurrency"]);
    assert!(!servers.is_empty(), "no server for {pool}");
    let mut replicas = 0;
    for c in servers {
        let w = &c.words;
        match target {
            "sglang" => {
                assert_eq!(c.num("--tp-size"), tp, "{w:?}");
                assert_eq!(
                    c.opt("--pp-size").map_or(1, |_| c.num("--pp-size")),
                    pp,
                    "{w:?}"
                );
                let dp = c.opt("--dp-size").map_or(1, |_| c.num("--dp-size"));
                // --max-running-requests is per --dp-size replica: the instance's.
                assert_eq!(c.num("--max-running-requests"), concurrency, "{w:?}");
                assert_eq!(
                    c.opt("--chunked-prefill-size")
                        .map(|_| c.num("--chunked-prefill-size")),
                    chunk,
                    "{w:?}"
                );
                assert_eq!(c.opt("--host").as_deref(), Some("0.0.0.0"), "{w:?}");
                if c.opt("--node-rank").is_none_or(|r| r == "0") {
                    replicas += dp;
                }
            }
            _ => {
                assert_eq!(c.num("--tensor-parallel-size"), tp, "{w:?}");
                let dp = c
                    .opt("--data-parallel-size")
                    .map_or(1, |_| c.num("--data-parallel-size"));
                assert_eq!(c.num("--max-num-seqs"), concurrency, "{w:?}");
                assert_eq!(
                    c.opt("--max-num-batched-tokens")
                        .map(|_| c.num("--max-num-batched-tokens")),
                    chunk,
                    "{w:?}"
                );
                assert_eq!(c.has("--enable-chunked-prefill"), chunk.is_some(), "{w:?}");
                replicas += dp;
            }
        }
    }
    assert_eq!(replicas, inst, "every instance is started once: {pool}");
}

/// No two servers on a node share a GPU or a port.
#[track_caller]
fn no_collisions(target: &str, servers: &[&Command]) {
    let mut gpus: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    let mut ports: BTreeSet<(String, u64)> = BTreeSet::new();
    for c in servers {
        let node = c.above.split(',').next().unwrap_or_default().to_string();
        assert!(
            node.starts_with("node"),
            "each server names its node: {}",
            c.above
        );
        if c.opt("--node-rank").is_some_and(|r| r != "0") {
            continue;
        }
        assert!(
            ports.insert((node.clone(), c.num("--port"))),
            "port reused on {node}: {:?}",
            c.words
        );
        let ids: Vec<u64> = match target {
            "sglang" => {
                let width = c.num("--tp-size")
                    * c.opt("--pp-size").map_or(1, |_| c.num("--pp-size"))
                    * c.opt("--dp-size").map_or(1, |_| c.num("--dp-size"));
                if c.opt("--nnodes").is_some() {
                    continue;
                }
                let base = c.num("--base-gpu-id");
                (base..base + width).collect()
            }
            _ => match c.env.get("CUDA_VISIBLE_DEVICES") {
                Some(d) => d.split(',').map(|g| g.parse().expect("a GPU")).collect(),
                None => continue,
            },
        };
        for g in ids {
            assert!(
                gpus.entry(node.clone()).or_default().insert(g),
                "GPU {g} of {node} twice"
            );
        }
    }
}

/// Llama 3 70B on one H200 node: aggregated wins; the export starts its instances
/// (SGLang's --dp-size and vLLM's --data-parallel-size on one node) with the
/// deployment's prefill chunk and requests in flight, and needs no router.
#[test]
fn aggregated_llama3_70b_exports_its_instances_with_chunk_and_concurrency() {
    let (plan, v) = deploy("agg", &[LLAMA, H200]);
    let s = &v["serving"];
    assert_eq!(s["mode"], "aggregated");
    let pool = &s["decode"];
    let chunk = u(&pool["chunked_prefill"]);
    assert!(chunk > 0, "{pool}");
    for target in ["sglang", "vllm"] {
        let text = export(&plan, target);
        let cmds = commands(&text);
        let srv = servers(&cmds, target);
        check_pool(target, pool, &srv, Some(chunk));
        no_collisions(target, &srv);
        assert!(
            routers(&cmds, target).len() <= usize::from(srv.len() > 1),
            "{text}"
        );
        assert!(
            text.starts_with(&format!(
                "# meshplan export --to {target}: llama3-70b-inference served aggregated on 8 "
            )),
            "{text}"
        );
        assert!(
            !text.contains("--disaggregation") && !text.contains("--kv-transfer-config"),
            "{text}"
        );
        // The plan's instances, one --dp-size or --data-parallel-size launch on the node.
        let inst = u(&pool["instances"]);
        if inst > 1 {
            let dp = if target == "sglang" {
                "--dp-size"
            } else {
                "--data-parallel-size"
            };
            assert_eq!(srv.len(), 1, "{text}");
            assert_eq!(srv[0].num(dp), inst, "{text}");
        }
        // The context: the workload's longest request.
        let w = &v["workload"];
        let context = u(&w["prompt_len"]) + u(&w["output_len"]);
        let flag = if target == "sglang" {
            "--context-length"
        } else {
            "--max-model-len"
        };
        assert!(srv.iter().all(|c| c.num(flag) == context), "{text}");
    }
}

/// A disaggregated deployment: every prefill and decode server with its pool's
/// degrees and role, the KV connector, and the router pairing them.
#[test]
fn disaggregated_exports_both_pools_and_the_router() {
    let w = workload("disagg", "serving: {mode: disaggregated}\n");
    let w = w.display().to_string();
    let (plan, v) = deploy("disagg", &[LLAMA, H200, "--workload", &w]);
    let s = &v["serving"];
    assert_eq!(s["mode"], "disaggregated");
    let one_node = s["kv_transfer"]["link"] == "nvlink";
    for target in ["sglang", "vllm"] {
        let text = export(&plan, target);
        let cmds = commands(&text);
        let srv = servers(&cmds, target);
        let prefill = of_role(&srv, target, "prefill");
        let decode = of_role(&srv, target, "decode");
        assert_eq!(
            prefill.len() + decode.len(),
            srv.len(),
            "every server has a role:\n{text}"
        );
        check_pool(
            target,
            &s["prefill"],
            &prefill,
            Some(u(&s["prefill"]["chunked_prefill"])),
        );
        check_pool(target, &s["decode"], &decode, None);
        no_collisions(target, &srv);
        let router = routers(&cmds, target);
        assert_eq!(router.len(), 1, "{text}");
        let router = router[0];
        match target {
            "sglang" => {
                let backend = if one_node { "nixl" } else { "mooncake" };
                for c in &srv {
                    assert_eq!(
                        c.opt("--disaggregation-transfer-backend").as_deref(),
                        Some(backend),
                        "{:?}",
                        c.words
                    );
                }
                assert!(router.has("--pd-disaggregation"), "{text}");
                // Each prefill server with its bootstrap port, each decode server.
                let n_prefill = router.words.iter().filter(|w| *w == "--prefill").count();
                let n_decode = router.words.iter().filter(|w| *w == "--decode").count();
                assert_eq!(n_prefill, prefill.len(), "{text}");
                assert_eq!(n_decode, decode.len(), "{text}");
                for c in &prefill {
                    let url = format!("http://NODE0:{}", c.num("--port"));
                    let at = router
                        .words
                        .iter()
                        .position(|w| *w == url)
                        .expect("the prefill URL");
                    assert_eq!(
                        router.words[at + 1],
                        c.num("--disaggregation-bootstrap-port").to_string(),
                        "{text}"
                    );
                }
            }
            _ => {
                for c in &srv {
                    assert_eq!(
                        c.opt("--kv-transfer-config").as_deref(),
                        Some(r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#),
                        "{:?}",
                        c.words
                    );
                    assert!(
                        c.env.contains_key("VLLM_NIXL_SIDE_CHANNEL_PORT"),
                        "{:?}",
                        c.env
                    );
                }
                let ports: BTreeSet<&String> = srv
                    .iter()
                    .map(|c| &c.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
                    .collect();
                assert_eq!(
                    ports.len(),
                    srv.len(),
                    "one NIXL side channel per server:\n{text}"
                );
                assert!(router.has("--vllm-pd-disaggregation"), "{text}");
                assert_eq!(
                    router.words.iter().filter(|w| *w == "--prefill").count(),
                    prefill.len(),
                    "{text}"
                );
                assert_eq!(
                    router.words.iter().filter(|w| *w == "--decode").count(),
                    decode.len(),
                    "{text}"
                );
            }
        }
    }
}

/// Prompt and output length distributions: the plan's lengths are their means, and
/// every server accepts the longest request (longest prompt + longest output).
#[test]
fn servers_accept_the_longest_request_of_the_distributions() {
    let w = workload(
        "dist",
        "serving:\n  mode: disaggregated\n  prompt: {quantiles: {\"50\": 1024, \"90\": 3000, \"99\": 6000}}\n  output: {histogram: [[128, 1], [512, 1]]}\n",
    );
    let w = w.display().to_string();
    let (plan, v) = deploy("dist", &[LLAMA, H200, "--workload", &w, "--config", "tp=4"]);
    assert!(
        u(&v["workload"]["prompt_len"]) < 6000,
        "the plan prices the mean"
    );
    for (target, flag) in [("sglang", "--context-length"), ("vllm", "--max-model-len")] {
        let text = export(&plan, target);
        let cmds = commands(&text);
        let srv = servers(&cmds, target);
        assert!(srv.len() >= 2, "{text}");
        for c in srv {
            assert_eq!(c.num(flag), 6000 + 512, "{:?}", c.words);
        }
    }
}

/// Pools on two nodes: the KV cache crosses InfiniBand (SGLang's Mooncake), each
/// pool on its own node, each server's node named above it.
#[test]
fn disaggregated_over_two_nodes_puts_each_pool_on_its_node() {
    let w = workload("disagg2", "serving: {mode: disaggregated}\n");
    let w = w.display().to_string();
    let (plan, v) = deploy(
        "disagg2",
        &[
            LLAMA,
            H200,
            "--nodes",
            "2",
            "--workload",
            &w,
            "--config",
            "tp=8",
        ],
    );
    assert_eq!(v["serving"]["kv_transfer"]["link"], "infiniband");
    let text = export(&plan, "sglang");
    let cmds = commands(&text);
    let srv = servers(&cmds, "sglang");
    let prefill = of_role(&srv, "sglang", "prefill");
    let decode = of_role(&srv, "sglang", "decode");
    assert!(
        prefill.iter().all(|c| c.above.starts_with("node 0,")),
        "{text}"
    );
    assert!(
        decode.iter().all(|c| c.above.starts_with("node 1,")),
        "{text}"
    );
    assert!(
        srv.iter()
            .all(|c| c.opt("--disaggregation-transfer-backend").as_deref() == Some("mooncake")),
        "{text}"
    );
    let router = routers(&cmds, "sglang");
    assert!(
        router[0]
            .words
            .iter()
            .any(|w| w.starts_with("http://NODE1:")),
        "{text}"
    );
    let v = export(&plan, "vllm");
    assert!(v.contains("VLLM_NIXL_SIDE_CHANNEL_HOST=NODE1 "), "{v}");
}

/// A server wider than a node: SGLang gets one line per node with its rank and the
/// server's first node as --dist-init-addr; vLLM one line, on a Ray cluster.
#[test]
fn a_server_over_two_nodes_has_a_line_per_node() {
    let (plan, _) = deploy("tp16", &[LLAMA, H200, "--nodes", "2", "--config", "tp=16"]);
    let text = export(&plan, "sglang");
    let cmds = commands(&text);
    let srv = servers(&cmds, "sglang");
    assert_eq!(srv.len(), 2, "{text}");
    for (rank, c) in srv.iter().enumerate() {
        assert_eq!(c.num("--nnodes"), 2, "{text}");
        assert_eq!(c.num("--node-rank"), rank as u64, "{text}");
        assert_eq!(
            c.opt("--dist-init-addr").as_deref(),
            Some("NODE0:20000"),
            "{text}"
        );
        assert!(
            c.above.starts_with(&format!("node {rank}, every GPU")),
            "{text}"
        );
    }
    let v = export(&plan, "vllm");
    let cmds = commands(&v);
    let srv = servers(&cmds, "vllm");
    assert_eq!(srv.len(), 1, "{v}");
    assert!(srv[0].env.is_empty() && srv[0].above.contains("Ray"), "{v}");
}

/// Every option a deployment's export writes exists in the framework's released
/// source (vLLM's list holds its engine options; --port is the OpenAI server's).
#[test]
fn every_deployment_option_is_spelled_as_the_framework_defines_it() {
    let w = workload("spell", "serving: {mode: disaggregated}\n");
    let w = w.display().to_string();
    let (agg, _) = deploy("spell-agg", &[LLAMA, H200]);
    let (dis, _) = deploy("spell-dis", &[LLAMA, H200, "--workload", &w]);
    for target in ["sglang", "vllm"] {
        let names = defined(target);
        assert!(names.len() > 50, "{target}");
        for plan in [&agg, &dis] {
            let text = export(plan, target);
            let cmds = commands(&text);
            for c in servers(&cmds, target) {
                for name in c.opts().into_keys() {
                    assert!(
                        names.contains(name) || (target == "vllm" && name == "--port"),
                        "{target} does not define {name}: {:?}",
                        c.words
                    );
                }
            }
        }
    }
}

/// The refusals still apply, per pool and named by it: vLLM's DP-attention refusal
/// of a Mixtral deployment, vLLM's batch that must hold every sequence, and a
/// disaggregated plan without its prefill pool; training targets refuse serving.
#[test]
fn refusals_name_the_pool() {
    let (mix, _) = deploy(
        "mix-dpa",
        &[
            MIXTRAL,
            H200,
            "--workload",
            INFERENCE,
            "--config",
            "dp_attention=true",
        ],
    );
    let r = meshplan(&["export", &mix, "--to", "vllm"]);
    r.expect_code(3);
    assert!(
        r.stderr
            .starts_with("error: cannot export this plan to vllm: the instances: dp_attention"),
        "{}",
        r.stderr
    );
    export(&mix, "sglang");

    // A chunk smaller than the requests in flight: vLLM's scheduler refuses it.
    let (agg, mut v) = deploy("agg-small-chunk", &[LLAMA, H200]);
    let seqs = u(&v["serving"]["decode"]["concurrency"]);
    v["serving"]["decode"]["chunked_prefill"] = (seqs - 1).into();
    let small = PathBuf::from(&agg).with_file_name("agg-small-chunk-edited.json");
    std::fs::write(&small, serde_json::to_vec(&v).expect("json")).expect("write");
    let small = small.display().to_string();
    let r = meshplan(&["export", &small, "--to", "vllm"]);
    r.expect_code(3);
    assert!(
        r.stderr
            .contains("the instances: vLLM needs --max-num-batched-tokens")
            && r.stderr
                .contains(&format!("--max-num-seqs ({seqs} requests per engine)")),
        "{}",
        r.stderr
    );
    let s = export(&small, "sglang");
    assert!(
        s.contains(&format!("--chunked-prefill-size {}", seqs - 1)),
        "{s}"
    );

    // No prefill plan: named, not guessed.
    let w = workload("no-prefill", "serving: {mode: disaggregated}\n");
    let w = w.display().to_string();
    let (dis, mut v) = deploy("no-prefill", &[LLAMA, H200, "--workload", &w]);
    v["serving"]
        .as_object_mut()
        .expect("serving")
        .remove("prefill_plan");
    let lacking = PathBuf::from(&dis).with_file_name("no-prefill-edited.json");
    std::fs::write(&lacking, serde_json::to_vec(&v).expect("json")).expect("write");
    let lacking = lacking.display().to_string();
    for target in ["sglang", "vllm"] {
        let r = meshplan(&["export", &lacking, "--to", target]);
        r.expect_code(3);
        assert!(r.stderr.contains("lacks its prefill pool"), "{}", r.stderr);
    }
    let r = meshplan(&["export", &dis, "--to", "megatron"]);
    r.expect_code(3);
    assert!(r.stderr.contains("inference plan"), "{}", r.stderr);
}
