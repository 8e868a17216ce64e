//! Serving deployments (`meshplan deploy`): the KV cache and its move between pools,
//! the decode step's physics, DP-attention's per-layer volumes, queueing and
//! continuous batching against hand-worked numbers; the Llama 3 70B and DeepSeek-V3
//! deployments through the command line; what an unmeetable SLO prints.
//!
//! Every expected value is written out from its formula in the comment beside it.

use crate::cli::{meshplan, temp_file};
use meshplan_cost_model::serving::{
    aggregated, disaggregated, frontier, fused_iteration_s, kv_bytes_per_token, kv_transfer,
    md1_wait, InstanceCost, KvMove, ServeLoad, ServePoint,
};
use meshplan_cost_model::{
    estimate_inference, load_cluster, prepare_model, Estimate, InferenceLoad, PreparedGraph,
};
use meshplan_ir::serving::{LenDist, ModeChoice, Objective, ServingMode};
use meshplan_ir::{load_model, ParallelConfig, PartialConfig, WorkloadOverrides};
use std::path::PathBuf;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

fn root(rel: &str) -> String {
    PathBuf::from(ROOT).join(rel).display().to_string()
}

fn prepared(rel: &str) -> PreparedGraph {
    let spec = load_model(&PathBuf::from(root(rel)), &WorkloadOverrides::default())
        .unwrap_or_else(|e| panic!("{rel}: {e}"));
    prepare_model(&spec).unwrap()
}

fn cfg(text: &str, gpus: u64) -> ParallelConfig {
    PartialConfig::parse(text, "--config")
        .and_then(|p| p.resolve(gpus, "--config"))
        .unwrap_or_else(|e| panic!("{text}: {e}"))
}

#[track_caller]
fn close(what: &str, got: f64, want: f64, tol: f64) {
    let err = (got - want).abs() / want.abs().max(f64::MIN_POSITIVE);
    assert!(
        err <= tol,
        "{what}: got {got}, want {want} (relative error {err:.3e})"
    );
}

fn load(prompt: u64, output: u64, conc: u64) -> InferenceLoad {
    InferenceLoad {
        prompt_len: prompt,
        output_len: output,
        concurrency: conc,
        ttft_max_s: None,
        tpot_max_s: None,
    }
}

// === KV cache bytes and the move between pools ===

#[test]
fn kv_bytes_per_token_gqa_and_mla() {
    // Llama 3 70B (GQA): 80 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes = 327,680.
    assert_eq!(
        kv_bytes_per_token(&prepared("models/llama3-70b-inference.yaml")),
        327_680.0
    );
    // DeepSeek-V3 (MLA): 61 layers x (kv_lora_rank 512 + rope 64) x 2 bytes = 70,272.
    assert_eq!(
        kv_bytes_per_token(&prepared("models/deepseek-v3.yaml")),
        70_272.0
    );
}

#[test]
fn kv_transfer_over_nvlink_and_infiniband() {
    let pg = prepared("models/llama3-70b-inference.yaml");
    let h200 = load_cluster(&PathBuf::from(root("topologies/h200-node.yaml")), Some(2)).unwrap();
    // A 2048-token prompt: 2048 x 327,680 = 671,088,640 bytes. Prefill tp=4 holds 2
    // KV heads per GPU, decode tp=8 one: the busiest GPU is the prefill one, sending
    // 671,088,640 / 4 = 167,772,160 bytes.
    let (p4, d8) = (cfg("tp=4", 4), cfg("tp=8", 8));
    let nv = kv_transfer(&pg, &h200, &p4, &d8, 2048.0, true);
    assert_eq!(nv.bytes, 671_088_640.0);
    assert_eq!(nv.bytes_per_gpu, 167_772_160.0);
    // NVLink4: 3 us + 167,772,160 B / (450 GB/s x 0.78 NVLink efficiency)
    //   = 3e-6 + 167,772,160 / 3.51e11 = 481.0 us.
    close(
        "NVLink",
        nv.time_s,
        3e-6 + 167_772_160.0 / (450e9 * 0.78),
        1e-9,
    );
    // InfiniBand NDR: 6 us + 167,772,160 / 50 GB/s = 3.361 ms, seven times slower.
    let ib = kv_transfer(&pg, &h200, &p4, &d8, 2048.0, false);
    close("IB", ib.time_s, 6e-6 + 167_772_160.0 / 50e9, 1e-9);
    // DeepSeek-V3's latent has one "head": replicated over tp, every decode GPU
    // receives the whole 2048 x 70,272 = 143,917,056 bytes, unless pipeline stages
    // split the layers: pp=2 halves it.
    let ds = prepared("models/deepseek-v3.yaml");
    let m = kv_transfer(
        &ds,
        &h200,
        &cfg("tp=8", 8),
        &cfg("tp=4,pp=2", 8),
        2048.0,
        false,
    );
    assert_eq!(m.bytes, 143_917_056.0);
    assert_eq!(m.bytes_per_gpu, 143_917_056.0);
    let m2 = kv_transfer(
        &ds,
        &h200,
        &cfg("tp=4,pp=2", 8),
        &cfg("tp=4,pp=2", 8),
        2048.0,
        false,
    );
    assert_eq!(m2.bytes_per_gpu, 143_917_056.0 / 2.0);
    // The 4 decode copies per stage are served by the 8 prefill copies taking turns:
    // each prefill GPU sends its stage's share once; 4 copies cross the link.
    assert_eq!(m.moved, 4.0 * 143_917_056.0);
    // Llama's 8 KV heads: prefill tp=1 sends each head once to decode tp=8 (no
    // copies): the whole cache from the one prefill GPU.
    let l1 = kv_transfer(&pg, &h200, &cfg("tp=1", 1), &d8, 2048.0, true);
    assert_eq!((l1.bytes_per_gpu, l1.moved), (671_088_640.0, 671_088_640.0));
}

// === The decode step ===

#[test]
fn decode_step_is_the_larger_of_weight_reads_and_compute_plus_kv_reads() {
    // Llama 3 70B, tp=8 on one H200 node: HBM 4.8 TB/s x 0.70 = 3.36 TB/s achieved.
    // Weights per GPU W = 19.5 GB (70.55e9 x 2 / 8 and the embedding kept whole on
    // every rank): 5.8 ms to read. The KV cache read per step is B x ctx x 327,680 / 8
    // bytes; FLOPs per step 2 x 70.55e9 x B / 8.
    let pg = prepared("models/llama3-70b-inference.yaml");
    let h200 = load_cluster(&PathBuf::from(root("topologies/h200-node.yaml")), None).unwrap();
    let c = cfg("tp=8", 8);
    let hbm = 4800e9 * 0.70;
    let compute = |b: u64| -> (f64, Estimate) {
        let e = estimate_inference(&pg, &h200, &c, &load(2048, 256, b)).unwrap();
        (e.time_breakdown_s.compute, e)
    };
    let (c1, e1) = compute(1);
    let w = e1.memory_per_gpu_bytes.params / hbm;
    let ctx = 2048.0 + 128.0;
    let kv = |b: f64| b * ctx * 327_680.0 / 8.0 / hbm;
    // B = 1: weight-bound (17.6 GFLOP / 8 GPUs is 2 us of compute): W + KV(1), plus
    // the fixed cost of each kernel, at most 16 ops x 80 layers x 3 us = 3.84 ms.
    assert!(c1 >= w + kv(1.0), "{c1} < {}", w + kv(1.0));
    assert!(c1 - w - kv(1.0) <= 16.0 * 80.0 * 3e-6, "{c1}");
    // B = 64: 63 more requests add at least their KV read, 63 x 26.5 us = 1.67 ms
    // (2176 x 40,960 bytes each); the rest is the 64-row GEMMs' tile and wave losses.
    let (c64, _) = compute(64);
    close(
        "KV read of 63 requests",
        kv(64.0) - kv(1.0),
        63.0 * 2176.0 * 40_960.0 / hbm,
        1e-12,
    );
    assert!(c64 - c1 >= kv(64.0) - kv(1.0), "{c64} - {c1}");
    // B = 1024: compute-bound. 2 x 70.55e9 x 1024 / 8 = 18.1 TFLOP: at least 18.3 ms
    // at the 989 TFLOP/s peak, above the 5.8 ms weight read; plus the KV read.
    let (c1024, _) = compute(1024);
    let flops = 2.0 * pg.params_total * 1024.0 / 8.0;
    assert!(c1024 - kv(1024.0) >= flops / 989e12, "{c1024}");
    assert!(c1024 - kv(1024.0) > 3.0 * w);
}

#[test]
fn dp_attention_gathers_and_scatters_tokens_around_each_mlp() {
    // DeepSeek-style DP-attention on a MoE model: attention data-parallel over the
    // tp=8 ranks, the MLP half gathers the replica's B tokens first (AllGather) and
    // scatters them back after (ReduceScatter), each (N-1)/N x B x H x D:
    //   B = 64, H = 1024, D = 2, N = 8: 2 x 7/8 x 64 x 1024 x 2 = 229,376 bytes per
    //   layer. Taken as the difference of 4 and 2 layers, over 2 layers.
    let moe = |layers: u64| {
        let yaml = format!(
            "name: m\ntransformer: {{layers: {layers}, hidden: 1024, heads: 8, ffn_hidden: 4096, mlp: swiglu, norm: rmsnorm, vocab: 32000, moe: {{experts: 8, top_k: 2, expert_ffn_hidden: 1024}}}}\ndtype: bf16\n"
        );
        let spec = meshplan_ir::parse_model_yaml(&yaml, "m.yaml").unwrap();
        prepare_model(&spec).unwrap()
    };
    let cl = load_cluster(&PathBuf::from(root("topologies/h200-node.yaml")), None).unwrap();
    let c = cfg("tp=8,dp_attention=true", 8);
    let tp = |l| {
        estimate_inference(&moe(l), &cl, &c, &load(512, 64, 64))
            .unwrap()
            .comm_bytes_per_gpu
            .tp
    };
    let per_layer = (tp(4) - tp(2)) / 2.0;
    let want = 2.0 * 7.0 / 8.0 * 64.0 * 1024.0 * 2.0;
    assert_eq!(want, 229_376.0);
    close("DP-attention bytes per layer", per_layer, want, 1e-12);
}

#[test]
fn dp_attention_holds_whole_attention_weights_and_split_mlp_weights() {
    // Llama 3 70B under DP-attention at tp=8: each tensor rank attends requests of
    // its own, so it holds the attention half's weights whole; the MLP runs over
    // the gathered tokens split over tp, and the embedding and head are
    // vocabulary-parallel (their collectives are `column`'s and `row`'s). Bf16:
    //   attention, 80 x (8192 x 10240 qkv + 8192 x 8192 out) = 12,079,595,520 whole;
    //   MLP, 80 x (8192 x 57344 gate|up + 28672 x 8192 down) = 56,371,445,760 / 8;
    //   embedding and head, 2 x 128256 x 8192 = 2,101,346,304 / 8;
    //   norms, 2 x 80 x 8192 + 8192 = 1,318,912 on every rank;
    //   19,390,013,440 values, 38,780,026,880 bytes a GPU.
    // Holding every tp-split weight whole, as the estimate did, is 141,107,412,992
    // bytes: more than an H200 holds.
    let pg = prepared("models/llama3-70b-inference.yaml");
    let cl = load_cluster(&PathBuf::from(root("topologies/h200-node.yaml")), None).unwrap();
    let e = estimate_inference(
        &pg,
        &cl,
        &cfg("tp=8,dp_attention=true", 8),
        &load(2048, 256, 64),
    )
    .unwrap();
    assert_eq!(e.memory_per_gpu_bytes.params, 38_780_026_880.0);
    // Without DP-attention every tp-split weight is an eighth.
    let e = estimate_inference(&pg, &cl, &cfg("tp=8", 8), &load(2048, 256, 64)).unwrap();
    let all = 12_079_595_520.0 + 56_371_445_760.0 + 2_101_346_304.0;
    assert_eq!(
        e.memory_per_gpu_bytes.params,
        2.0 * (all / 8.0 + 1_318_912.0)
    );
}

#[test]
fn a_dp_attention_pool_serves_a_prompt_a_rank_while_a_lone_prompt_waits_on_one() {
    // Under DP-attention a lone prompt's attention runs whole on one tensor rank
    // (its TTFT), while a busy prefill pool has each attention rank prefill a prompt
    // of its own: its service time per prompt takes an eighth of the attention
    // half. Without DP-attention both are one prompt's prefill.
    let spec = meshplan_ir::parse_model_yaml(
        "name: m\ntransformer: {layers: 4, hidden: 1024, heads: 8, ffn_hidden: 4096, mlp: swiglu, norm: rmsnorm, vocab: 32000, moe: {experts: 8, top_k: 2, expert_ffn_hidden: 1024}}\ndtype: bf16\n",
        "m.yaml",
    )
    .unwrap();
    let pg = prepare_model(&spec).unwrap();
    let cl = load_cluster(&PathBuf::from(root("topologies/h200-node.yaml")), None).unwrap();
    for (c, dpa) in [
        ("tp=8,dp_attention=true", true),
        ("tp=8,dp_attention=false", false),
    ] {
        let c = cfg(c, 8);
        let ttft = estimate_inference(&pg, &cl, &c, &load(2048, 64, 1))
            .unwrap()
            .ttft_s
            .unwrap();
        let service = meshplan_cost_model::prefill_service_s(&pg, &cl, &c, 2048).unwrap();
        if dpa {
            assert!(service < ttft, "service {service} s, TTFT {ttft} s");
        } else {
            assert_eq!(service, ttft);
        }
        // A pool prices its queue by the service time and a prompt's own wait by
        // its TTFT.
        let inst = meshplan_cost_model::serving::price_instance(
            &pg,
            &cl,
            &c,
            1,
            &serve_load(2048.0, 64.0),
        )
        .unwrap()
        .expect("fits");
        assert_eq!(inst.prefill_mean_s, service);
        assert_eq!(inst.prefill_at_s, ttft);
    }
}

// === Queueing, continuous batching, pools ===

fn instance(prefill_s: f64, weight_s: f64, decode: Vec<(u64, f64)>) -> InstanceCost {
    InstanceCost {
        cfg: cfg("tp=8", 8),
        dcp: 1,
        gpus: 8,
        prefill_mean_s: prefill_s,
        prefill_at_s: prefill_s,
        weight_read_s: weight_s,
        kv_capacity: 1000,
        decode,
    }
}

fn serve_load(prompt: f64, output: f64) -> ServeLoad {
    ServeLoad {
        prompt_mean: prompt,
        prompt_at: prompt,
        output_mean: output,
        output_at: output,
        percentile: 0.5,
        ttft_max_s: None,
        tpot_max_s: None,
        min_user_tps: None,
        arrival_rate: None,
        concurrency: (1, 1000),
        chunks: vec![2048],
        objective: Objective::PerGpu,
        mode: ModeChoice::Both,
    }
}

#[test]
fn continuous_batching_by_hand() {
    // An instance: prefill of the 2048-token mean prompt 200 ms, weights read in 5 ms,
    // decode step at 32 requests 20 ms. Output 256 tokens, chunk 2048.
    let inst = instance(0.200, 0.005, vec![(32, 0.020)]);
    let l = serve_load(2048.0, 256.0);
    // Prompt tokens per iteration to replace finished requests: 32 x 2048 / 256 = 256;
    // their share of a prefill is 256 / 2048 x 200 ms = 25 ms; fused with the decode
    // step, weights read once: 20 + 25 - 5 = 40 ms = TPOT.
    assert!((fused_iteration_s(&inst, 0.020, 256.0, 2048.0) - 0.040).abs() < 1e-15);
    let p = aggregated(&inst, 32, 0.020, 2048, 1, &l).unwrap();
    close("TPOT", p.tpot_s, 0.040, 1e-12);
    // A full-chunk iteration: 20 + 200 - 5 = 215 ms. Load rho = 256 / 2048 = 1/8;
    // M/D/1 wait 0.125 / (2 x 0.875) = 1/14 service times of 215 ms; then one
    // iteration: TTFT = 215 / 14 + 215 = 230.36 ms.
    close("TTFT", p.ttft_s, 0.215 / 14.0 + 0.215, 1e-12);
    // 32 requests / (256 x 40 ms) = 3.125 requests/s = 800 tokens/s on 8 GPUs.
    close("tokens/s", p.tokens_per_s, 800.0, 1e-12);
    close("per GPU", p.per_gpu(), 100.0, 1e-12);
    // A chunk of 256 cannot keep up past rho 0.9 (256 needed per iteration).
    assert!(aggregated(&inst, 32, 0.020, 256, 1, &l).is_none());
    assert_eq!(md1_wait(0.125), 1.0 / 14.0);
}

#[test]
fn disaggregated_pools_by_hand() {
    // Prefill instance: 200 ms per prompt, 5 requests/s at most. Decode instance: 64
    // requests, 25 ms steps: 64 / (256 x 25 ms) = 10 requests/s. KV move 2 ms.
    let pre = instance(0.200, 0.005, vec![]);
    let dec = instance(0.200, 0.005, vec![(64, 0.025)]);
    let kv = KvMove {
        bytes: 1.0,
        moved: 1.0,
        bytes_per_gpu: 1.0,
        time_s: 0.002,
        same_node: true,
    };
    let mut l = serve_load(2048.0, 256.0);
    // TTFT bound 500 ms leaves 298 ms for queueing: a = 298 / 200 = 1.49, rho_max =
    // 2a / (1 + 2a) = 2.98 / 3.98 = 0.7487. Two prefill instances: 2 x 5 x 0.7487 =
    // 7.487 requests/s < 10 the decode instance takes: the prefill pool bounds it.
    l.ttft_max_s = Some(0.5);
    let p = disaggregated(&pre, 2, &dec, 64, 0.025, 1, kv, None, &l).unwrap();
    let rho = 2.98 / 3.98;
    close("rate", p.request_rate, 10.0 * rho, 1e-12);
    close("TTFT at the bound", p.ttft_s, 0.5, 1e-12);
    assert_eq!(p.tpot_s, 0.025);
    assert_eq!(p.gpus, 24);
    close("per GPU", p.per_gpu(), 10.0 * rho * 256.0 / 24.0, 1e-12);
    // Three prefill instances: 15 x 0.7487 = 11.2 > 10: the decode pool bounds it at
    // 10 requests/s, load 10 / 15 = 2/3.
    let q = disaggregated(&pre, 3, &dec, 64, 0.025, 1, kv, None, &l).unwrap();
    close("rate", q.request_rate, 10.0, 1e-12);
    close("load", q.prefill_load, 2.0 / 3.0, 1e-12);
    // TTFT: (2/3) / (2/3) = 1 service time of 200 ms waiting, 200 ms prefill, 2 ms KV.
    close("TTFT", q.ttft_s, 0.402, 1e-12);
}

#[test]
fn frontier_keeps_what_nothing_beats() {
    let inst = instance(0.2, 0.005, vec![(1, 0.012), (16, 0.015), (64, 0.03)]);
    let l = serve_load(512.0, 256.0);
    let pts: Vec<ServePoint> = inst
        .decode
        .iter()
        .map(|&(b, s)| aggregated(&inst, b, s, 2048, 1, &l).unwrap())
        .collect();
    let mut slow = pts[2].clone();
    slow.tokens_per_s /= 2.0; // dominated by pts[2]
    let mut all = pts.clone();
    all.push(slow);
    let f = frontier(&all);
    assert_eq!(f.len(), 3, "{f:?}");
    assert!(!f.contains(&3));
    // Increasing per-user speed, decreasing per-GPU speed along it.
    for w in f.windows(2) {
        assert!(all[w[0]].per_user() < all[w[1]].per_user());
        assert!(all[w[0]].per_gpu() > all[w[1]].per_gpu());
    }
}

#[test]
fn length_distributions_by_hand() {
    let q: LenDist = serde_yaml_ng::from_str("quantiles: {50: 1000, 90: 3000}").unwrap();
    // Flat 1000 below p50, linear to 3000 at p90, flat 3000 above:
    // mean = 0.5 x 1000 + 0.4 x 2000 + 0.1 x 3000 = 1600.
    close("mean", q.mean(), 1600.0, 1e-12);
    close("p70", q.quantile(0.7), 2000.0, 1e-12);
    assert_eq!(q.quantile(0.99), 3000.0);
    let h: LenDist = serde_yaml_ng::from_str("histogram: [[512, 3], [4096, 1]]").unwrap();
    // 3/4 at 512, 1/4 at 4096: mean 1408; p50 512, p90 4096.
    close("mean", h.mean(), 1408.0, 1e-12);
    assert_eq!((h.quantile(0.5), h.quantile(0.9)), (512.0, 4096.0));
    let bad: LenDist = serde_yaml_ng::from_str("quantiles: {50: 3000, 90: 1000}").unwrap();
    assert!(bad.validate().unwrap_err().contains("must not decrease"));
}

// === Through the command line ===

#[test]
fn llama3_70b_on_one_h200_node() {
    let out = temp_file("deploy-llama70b.json", "");
    let figs = out.with_extension("figures");
    let r = meshplan(&[
        "deploy",
        &root("models/llama3-70b-inference.yaml"),
        &root("topologies/h200-node.yaml"),
        "-o",
        out.to_str().unwrap(),
        "--figures",
        figs.to_str().unwrap(),
        "--json",
    ]);
    let v = r.expect_code(0).json();
    let best = &v["best"];
    // The SLO of the model file: TTFT <= 2 s, TPOT <= 50 ms.
    assert!(best["ttft_s"].as_f64().unwrap() <= 2.0);
    assert!(best["tpot_s"].as_f64().unwrap() <= 0.050);
    assert_eq!(best["gpus"].as_u64().unwrap(), 8);
    let agg = &v["best_aggregated"];
    let dis = &v["best_disaggregated"];
    assert_eq!(agg["mode"], "aggregated");
    assert_eq!(dis["mode"], "disaggregated");
    assert!(agg["decode"]["concurrency_per_instance"].as_u64().unwrap() >= 1);
    assert!(dis["prefill"]["instances"].as_u64().unwrap() >= 1);
    assert!(dis["kv_transfer"]["link"] == "nvlink");
    // The best is the better of the two, and the verdict says which and why.
    let per_gpu = |p: &serde_json::Value| p["output_tokens_per_s_per_gpu"].as_f64().unwrap();
    assert_eq!(per_gpu(best), per_gpu(agg).max(per_gpu(dis)));
    let verdict = v["verdict"].as_str().unwrap();
    assert!(verdict.contains(" wins: ") && verdict.contains("tokens/s per GPU"));
    // The frontier rises in per-user speed as it falls in per-GPU speed.
    let f = v["frontier"].as_array().unwrap();
    assert!(f.len() >= 3);
    for w in f.windows(2) {
        assert!(
            w[0]["output_tokens_per_s_per_user"].as_f64()
                < w[1]["output_tokens_per_s_per_user"].as_f64()
        );
        assert!(per_gpu(&w[0]) > per_gpu(&w[1]));
    }
    // The plan file carries the deployment, and `plan`'s own keys for the decoding pool.
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(plan["serving"]["mode"], best["mode"]);
    assert!(plan["programs"].as_array().is_some_and(|p| !p.is_empty()));
    // `explain` says what it re-prices: the decoding pool, not the deployment.
    meshplan(&["explain", out.to_str().unwrap()])
        .expect_code(0)
        .stderr_has(&["a deployment from `deploy`", "the deployment itself: "]);
    let svg = std::fs::read_to_string(figs.join("frontier.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("tokens/s per GPU"));
}

#[test]
fn deepseek_v3_on_four_h200_nodes_uses_dp_attention_and_experts_over_gpus() {
    let w = temp_file(
        "deploy-dsv3-workload.yaml",
        "kind: inference\nprompt_len: 2048\noutput_len: 256\nslo: {ttft_ms: 2000, tpot_ms: 100}\n",
    );
    let out = temp_file("deploy-dsv3.json", "");
    let r = meshplan(&[
        "deploy",
        &root("models/deepseek-v3.yaml"),
        &root("topologies/h200-node.yaml"),
        "--nodes",
        "4",
        "--workload",
        w.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--json",
    ]);
    let v = r.expect_code(0).json();
    let c = &v["best"]["decode"]["config"];
    assert_eq!(c["dp_attention"], true, "{c}");
    assert!(c["ep"].as_u64().unwrap() > 1, "{c}");
    // The search over every instance of 1-32 GPUs stays well under a second.
    assert!(v["search"]["instances_tried"].as_u64().unwrap() > 100);
}

#[test]
fn unmeetable_slo_exits_3_with_the_closest_miss_and_what_would_meet_it() {
    let w = temp_file(
        "deploy-tight.yaml",
        "kind: inference\nprompt_len: 2048\noutput_len: 256\nslo: {ttft_ms: 2000, tpot_ms: 5}\n",
    );
    meshplan(&[
        "deploy",
        &root("models/llama3-70b-inference.yaml"),
        &root("topologies/h200-node.yaml"),
        "--workload",
        w.to_str().unwrap(),
        "-o",
        temp_file("deploy-tight.json", "").to_str().unwrap(),
    ])
    .expect_code(3)
    .stderr_has(&[
        "no deployment of `llama3-70b-inference`",
        "the closest misses TPOT",
        "> 5.0 ms",
        "a TPOT bound of",
    ]);
}

#[test]
fn bad_serving_input_exits_2_naming_the_field() {
    for (yaml, field) in [
        (
            "kind: inference\nprompt_len: 64\noutput_len: 8\nslo: {tpot_ms: 50, percentile: 150}\n",
            "workload.slo.percentile",
        ),
        (
            "kind: inference\nprompt_len: 64\noutput_len: 8\nserving: {prompt: {quantiles: {median: 10}}}\n",
            "workload.serving.prompt",
        ),
        (
            "kind: inference\nprompt_len: 64\noutput_len: 8\nserving: {concurrency: {min: 8, max: 2}}\n",
            "workload.serving.concurrency",
        ),
    ] {
        let w = temp_file("deploy-bad.yaml", yaml);
        meshplan(&[
            "deploy",
            &root("models/llama3-70b-inference.yaml"),
            &root("topologies/h200-node.yaml"),
            "--workload",
            w.to_str().unwrap(),
        ])
        .expect_code(2)
        .stderr_has(&[field]);
    }
    // A training workload is not served.
    meshplan(&[
        "deploy",
        &root("models/llama3-70b.yaml"),
        &root("topologies/h200-node.yaml"),
    ])
    .expect_code(2)
    .stderr_has(&["`deploy` plans serving", "kind: inference"]);
}

#[test]
fn a_length_distribution_and_an_arrival_rate() {
    // 4 requests/s of prompts p50 1024 / p90 4096: the fewest GPUs that serve it.
    let w = temp_file(
        "deploy-rate.yaml",
        "kind: inference\nprompt_len: 2048\noutput_len: 256\nslo: {ttft_ms: 2000, tpot_ms: 50, percentile: 90}\nserving:\n  prompt: {quantiles: {50: 1024, 90: 4096}}\n  arrival_rate: 4\n",
    );
    let v = meshplan(&[
        "deploy",
        &root("models/llama3-70b-inference.yaml"),
        &root("topologies/h200-node.yaml"),
        "--nodes",
        "2",
        "--workload",
        w.to_str().unwrap(),
        "-o",
        temp_file("deploy-rate.json", "").to_str().unwrap(),
        "--json",
    ])
    .expect_code(0)
    .json();
    assert_eq!(v["load"]["prompt_at_percentile"].as_f64(), Some(4096.0));
    assert_eq!(v["best"]["requests_per_s"].as_f64(), Some(4.0));
    // 4 requests/s x 256 tokens = 1024 tokens/s, on fewer GPUs than the 16 there are.
    close(
        "tokens/s",
        v["best"]["output_tokens_per_s"].as_f64().unwrap(),
        1024.0,
        1e-12,
    );
    assert!(v["best"]["gpus"].as_u64().unwrap() < 16);
    let _ = ServingMode::Aggregated;
}

// === Decode context parallelism (MLA) ===

#[test]
fn decode_context_parallelism_by_hand() {
    use meshplan_cost_model::serving::{dcp_step, kv_replicas};
    let ds = prepared("models/deepseek-v3.yaml");
    let llama = prepared("models/llama3-70b-inference.yaml");
    let h200 = load_cluster(&PathBuf::from(root("topologies/h200-node.yaml")), Some(2)).unwrap();
    // MLA's latent is copied on each of the 8 tensor ranks; Llama's 8 KV heads are
    // split over them; DP-attention keeps one copy per rank's own requests.
    assert_eq!(kv_replicas(&ds, &cfg("tp=8", 8)), 8);
    assert_eq!(kv_replicas(&ds, &cfg("tp=8,dp_attention=true", 8)), 1);
    assert_eq!(kv_replicas(&llama, &cfg("tp=8", 8)), 1);
    // dcp = 2 on tp = 8, B = 64 requests at a 2176-token context. Each GPU reads half
    // of each cache: saved (1 - 1/2) x 64 x 2176 x 1152 bytes x 61 layers at 3.36 TB/s
    // = 2.92 ms. Per layer it all-gathers the queries of its group's 2 x 128/8 heads
    // in the latent width (64 x 32 x 1152 = 2,359,296 bytes, half sent) and
    // reduce-scatters the partial outputs with an fp32 log-sum-exp (64 x 32 x 1156 =
    // 2,367,488 bytes, half sent): 61 x (1,179,648 + 1,183,744) = 144,166,912 bytes.
    let c = cfg("tp=8", 8);
    let d = dcp_step(&ds, &h200, &c, 2, 64.0, 2176.0);
    let saved = 0.5 * 64.0 * 2176.0 * 1152.0 * 61.0 / (4800e9 * 0.70);
    close("saved", d.saved_s, saved, 1e-12);
    assert_eq!(d.bytes, 144_166_912.0);
    let comm = meshplan_cost_model::CommModel::new(&h200);
    let group = meshplan_cost_model::GroupShape {
        size: 2,
        per_node: 2,
    };
    use meshplan_ir::plan::CollectiveKind::{AllGather, ReduceScatter};
    let per_layer =
        comm.time_s(AllGather, group, 2_359_296.0) + comm.time_s(ReduceScatter, group, 2_367_488.0);
    close("added", d.added_s, 61.0 * per_layer, 1e-12);
    // At this context the split saves more than the collectives cost.
    assert!(d.saved_s > d.added_s, "{d:?}");
    assert_eq!(dcp_step(&ds, &h200, &c, 1, 64.0, 2176.0).bytes, 0.0);
}

#[test]
fn long_contexts_on_deepseek_put_decode_context_parallelism_on_the_frontier() {
    // 32k-token prompts on 2 H200 nodes: the latent cache of 8 copies per tensor
    // group is what bounds the batch; splitting it (dcp) shows on the frontier.
    let w = temp_file(
        "deploy-dsv3-long.yaml",
        "kind: inference\nprompt_len: 32768\noutput_len: 1024\nslo: {ttft_ms: 30000, tpot_ms: 200}\n",
    );
    let v = meshplan(&[
        "deploy",
        &root("models/deepseek-v3.yaml"),
        &root("topologies/h200-node.yaml"),
        "--nodes",
        "2",
        "--workload",
        w.to_str().unwrap(),
        "-o",
        temp_file("deploy-dsv3-long.json", "").to_str().unwrap(),
        "--json",
    ])
    .expect_code(0)
    .json();
    let f = v["frontier"].as_array().unwrap();
    assert!(
        f.iter().any(|p| p["decode"]["dcp"].as_u64().unwrap() > 1),
        "{f:?}"
    );
    // Forced on, it is written to the plan and exported to both servers.
    let out = temp_file("deploy-dsv3-dcp.json", "");
    meshplan(&[
        "deploy",
        &root("models/deepseek-v3.yaml"),
        &root("topologies/h200-node.yaml"),
        "--nodes",
        "2",
        "--workload",
        w.to_str().unwrap(),
        "--dcp",
        "4",
        "--decode-config",
        "dp_attention=false",
        "-o",
        out.to_str().unwrap(),
    ])
    .expect_code(0);
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(plan["serving"]["decode"]["dcp"], 4);
    let sg = meshplan(&["export", out.to_str().unwrap(), "--to", "sglang"]);
    assert!(sg.expect_code(0).stdout.contains("--dcp-size 4"));
    let vl = meshplan(&["export", out.to_str().unwrap(), "--to", "vllm"]);
    assert!(vl
        .expect_code(0)
        .stdout
        .contains("--decode-context-parallel-size 4"));
}

#[test]
fn deepseek_v3_all_to_all_bytes_per_layer_by_hand() {
    // The instance `deploy` picks for DeepSeek-V3 on H200s: tp=8 with DP-attention,
    // two attention replicas, experts over all 16 GPUs. 64 requests decoding: 32
    // per replica, 32 / 8 = 4 tokens per GPU under DP-attention. Each routes to
    // K = 8 experts: dispatch and combine each send (ep-1)/ep x 4 x 8 x 7168 x 2
    // bytes: 2 x 15/16 x 458,752 = 860,160 bytes per MoE layer, x 58 MoE layers
    // (the first 3 of 61 are dense) = 49,889,280 bytes per decode step.
    let ds = prepared("models/deepseek-v3.yaml");
    let h200 = load_cluster(&PathBuf::from(root("topologies/h200-node.yaml")), Some(2)).unwrap();
    let c = cfg("tp=8,dp=2,ep=16,dp_attention=true", 16);
    let e = estimate_inference(&ds, &h200, &c, &load(2048, 256, 64)).unwrap();
    let per_layer = 2.0 * 15.0 / 16.0 * 4.0 * 8.0 * 7168.0 * 2.0;
    assert_eq!(per_layer, 860_160.0);
    close(
        "ep bytes per step",
        e.comm_bytes_per_gpu.ep,
        58.0 * per_layer,
        1e-12,
    );
    // Twice the requests, twice the bytes (proportional to tokens x K).
    let e2 = estimate_inference(&ds, &h200, &c, &load(2048, 256, 128)).unwrap();
    close(
        "ep bytes x2",
        e2.comm_bytes_per_gpu.ep,
        2.0 * 58.0 * per_layer,
        1e-12,
    );
}
