//! The device interpreter (`meshplan_executor::device`) on the host device: on every
//! plan it takes, it trains to exactly the losses, weights and communicated bytes
//! the general interpreter (deleted since) recorded as goldens
//! (`tests/data/golden/exec/device-*.txt`), so what differs on a GPU is the kernels
//! alone (tested against their CPU references in `meshplan_kernels::cuda`).

use crate::executor::{model, plan, plan_buckets, Model};
use meshplan_executor::comm::{AbortHandle, ByteCounts, Communicator, Group, ThreadComm};
use meshplan_executor::device::train::{supported, train_device};
use meshplan_executor::device::HostDevice;
use meshplan_executor::train::{byte_mismatches, train, TrainOptions, TrainReport};
use meshplan_ir::plan::Plan;

fn variant(edits: &[(&str, &str)], name: &str) -> Model {
    crate::matrix::variant("tiny-gpt", edits, name)
}

/// GPT-2's layout at tiny-gpt's sizes: LayerNorm with biases, GELU, learned
/// positions, the head tied to the token table, biases on every matmul.
fn gpt2_like() -> Model {
    gpt2_like_with(None, "gpt2-like.yaml")
}

/// [`gpt2_like`] with one more edit.
fn gpt2_like_with(edit: Option<(&str, &str)>, name: &str) -> Model {
    let mut edits = vec![
        ("mlp: swiglu", "mlp: gelu"),
        ("norm: rmsnorm", "norm: layernorm\n  bias: true"),
        ("tie_embeddings: false", "tie_embeddings: true"),
        ("position: rope", "position: learned\n  max_positions: 32"),
        ("kv_heads: 2", "kv_heads: 4"),
    ];
    edits.extend(edit);
    variant(&edits, name)
}

/// tiny-gpt with residual and attention dropout.
fn with_dropout() -> Model {
    variant(
        &[("position: rope", "position: rope\n  dropout: true")],
        "dropout.yaml",
    )
}

/// `a` and `b` trained alike: every loss, every rank's weights, byte counts and
/// state bytes.
fn same(cfg: &str, a: &TrainReport, b: &TrainReport) {
    assert_eq!(a.losses, b.losses, "{cfg}: losses");
    assert_eq!(a.ranks.len(), b.ranks.len(), "{cfg}: ranks");
    for (x, y) in a.ranks.iter().zip(&b.ranks) {
        assert!(x.weights == y.weights, "{cfg}: rank {} weights", x.rank);
        assert_eq!(x.counts, y.counts, "{cfg}: rank {} bytes", x.rank);
        assert_eq!(
            x.state_bytes, y.state_bytes,
            "{cfg}: rank {} state bytes",
            x.rank
        );
    }
}

/// Trains `p` on the host device: the general interpreter's golden fingerprint
/// (losses, weights, bytes, expert routing), the plan's bytes, a falling loss.
#[track_caller]
fn check(m: &Model, cfg: &str, p: Plan) {
    let opts = TrainOptions::default();
    supported(&p).unwrap_or_else(|e| panic!("{cfg}: {e}"));
    let run = train_device(&p, &opts, &|_| Ok(HostDevice)).unwrap_or_else(|e| panic!("{cfg}: {e}"));
    crate::exec_golden::check(
        &format!(
            "device-{}-{}-{cfg}",
            m.spec.name,
            crate::exec_golden::model_tag(&m.spec)
        ),
        &run,
    );
    let mut bytes = byte_mismatches(&p, &run, opts.steps);
    if p.strategy.ep > 1 && p.graph.dropless_experts() {
        // Dropless experts send what the router chose: the plan prices the mean
        // (tests/it/executor.rs bounds it); the golden pins the counts exactly.
        bytes.retain(|m| !m.contains(" ep: "));
    }
    assert!(bytes.is_empty(), "{cfg}: {}", bytes.join("\n"));
    assert!(
        run.losses[4] < run.losses[0],
        "{cfg}: the loss falls: {:?}",
        run.losses
    );
    eprintln!("{}: {cfg}: losses {:?}", m.spec.name, run.losses);
}

#[test]
fn device_interpreter_reproduces_the_general_ones_goldens_bit_for_bit() {
    let llama = model("tiny-gpt");
    for cfg in [
        "dp=1",
        "dp=2",
        "dp=2,mbs=1",
        "dp=1,mbs=2,recompute=full",
        "dp=2,recompute=selective",
    ] {
        check(&llama, cfg, plan(&llama, cfg));
    }
    let gpt2 = gpt2_like();
    for cfg in ["dp=1", "dp=2,mbs=2"] {
        check(&gpt2, cfg, plan(&gpt2, cfg));
    }
    // ZeRO-1 and -2: each data rank updates its part of the flat vector and the
    // parts are gathered; the flat layout (backward order) differs from the general
    // interpreter's (key order), which changes no value.
    for cfg in ["dp=2,zero=1", "dp=2,zero=2,mbs=1"] {
        check(&llama, cfg, plan(&llama, cfg));
    }
    let p = plan_buckets(&gpt2, "dp=2,zero=1", 10_000.0);
    check(&gpt2, "dp=2,zero=1 in 10k-parameter buckets", p);
    // Many buckets, each its own all-reduce over pieces of several weights.
    let p = plan_buckets(&gpt2, "dp=2", 10_000.0);
    let buckets = crate::executor::dense_grad_buckets(&p);
    assert!(buckets > 5, "{buckets} buckets");
    check(&gpt2, "dp=2 in 10k-parameter buckets", p);
}

/// Recomputation holds a block's input until its backward, not what the block
/// computes from it, and a layer's backward lets go of the layer. tiny-gpt, one
/// micro-batch of 8 x 32 = 256 rows, in floats a row: a layer computes 64
/// (norm1) + 128 (q|k|v) + 128 (RoPE) + 64 (attention) + 64 (projection) + 64
/// (residual) + 64 (norm2) + 256 (gate|up) + 128 (SwiGLU) + 64 (down) = 1024,
/// outputs 64 (its residual, the next layer's input) and keeps 1 + 1 (the
/// RMSNorms' scales) + 4 (a log-sum-exp a head) = 6 statistics; the embedding
/// holds 64 and the head 64 (norm) + 256 (logits) + 256 (their gradient) + 1.
/// - none: the peak is the forward's end, 64 + 2 x (1024 + 64 + 6) + 64 + 512 + 1
///   = 2829;
/// - full: the forward's end holds 64 + 64 + 64 + 64 + 512 + 1 = 769, and the
///   peak comes as the last layer is recomputed, the head let go: 64 (embedding)
///   + 64 (layer 0's output) + 1024 + 64 + 6 = 1222;
/// - selective (flash attention): only the log-sum-exps go, 2829 - 2 x 4 = 2821.
#[test]
fn recomputation_holds_a_blocks_input_and_a_backward_lets_its_layer_go() {
    let m = model("tiny-gpt");
    let opts = TrainOptions {
        steps: 2,
        ..TrainOptions::default()
    };
    let held = |cfg: &str| {
        let run = train(&plan(&m, cfg), &opts).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        (run.ranks[0].peak_activation_bytes, run.losses)
    };
    let (_, losses) = held("dp=1,mbs=8,recompute=none");
    for (recompute, floats) in [("none", 2829), ("full", 1222), ("selective", 2821)] {
        let (peak, same) = held(&format!("dp=1,mbs=8,recompute={recompute}"));
        assert_eq!(losses, same, "{recompute}");
        assert_eq!(peak, (256 * floats * 4) as f64, "{recompute}");
    }
}

/// Tensor parallelism on the device interpreter, with and without sequence
/// parallelism: split weights and heads, the program's sums, scatters and gathers
/// of activations and input gradients, a vocabulary-parallel table and loss; every
/// step's loss, every rank's weights and bytes as the general interpreter's.
#[test]
fn device_interpreter_runs_tensor_parallel_plans_bit_for_bit() {
    let llama = model("tiny-gpt");
    for cfg in [
        "tp=2,sp=false",
        "dp=2,tp=2,sp=false",
        "tp=2,sp=false,mbs=1,recompute=full",
        "dp=2,tp=2,sp=false,recompute=selective",
        "dp=2,tp=2,sp=false,zero=1",
        // Sequence parallelism: norms and residuals on a block of rows, gathered
        // for the split matmuls, scattered after them; the norms' gradients summed
        // over the tensor axis in the step.
        "tp=2,sp=true",
        "dp=2,tp=2,sp=true,mbs=1",
        "tp=2,sp=true,mbs=1,recompute=full",
        "dp=2,tp=2,sp=true,zero=1",
        "dp=2,tp=2,sp=true,zero=2,recompute=selective",
    ] {
        let p = plan(&llama, cfg);
        assert_eq!(p.strategy.sp, cfg.contains("sp=true"), "{cfg}");
        check(&llama, cfg, p);
    }
    // Biases on every matmul (a row-parallel one added by the first tensor rank
    // alone), LayerNorm, learned positions, the head tied to the token table.
    let gpt2 = gpt2_like();
    for cfg in [
        "tp=2,sp=false",
        "dp=2,tp=2,sp=false,mbs=1",
        "tp=4,sp=false",
        // The replicated position table looks up this rank's block of rows.
        "tp=2,sp=true",
        "dp=2,tp=4,sp=true,mbs=1",
    ] {
        check(&gpt2, cfg, plan(&gpt2, cfg));
    }
}

/// Pipeline parallelism on the device interpreter: stage boundaries sent and
/// received as device buffers (whole, or scattered over the tensor ranks and
/// gathered), 1F1B, GPipe and interleaved schedules, a tied table summed between
/// the first and the last stage; bit for bit with the general interpreter.
#[test]
fn device_interpreter_runs_pipeline_parallel_plans_bit_for_bit() {
    let llama = model("tiny-gpt");
    for cfg in [
        "pp=2,mbs=1",
        "dp=2,pp=2,mbs=1",
        "pp=2,mbs=1,schedule=gpipe",
        "tp=2,pp=2,mbs=1,sp=false",
        "dp=2,tp=2,pp=2,mbs=1,sp=true,zero=1",
        "pp=2,mbs=1,recompute=full",
    ] {
        check(&llama, cfg, plan(&llama, cfg));
    }
    let four = crate::executor::four_layers();
    check(&four, "pp=2,vpp=2,mbs=1", plan(&four, "pp=2,vpp=2,mbs=1"));
    let gpt2 = gpt2_like();
    for cfg in ["pp=2,mbs=1", "dp=2,tp=2,pp=2,mbs=1,sp=true"] {
        let p = plan(&gpt2, cfg);
        let tied = p.programs.iter().flat_map(|pr| &pr.phases).any(|ph| {
            ph.step.iter().any(|i| {
                matches!(
                    i,
                    meshplan_ir::plan::Instr::Collective {
                        target: meshplan_ir::plan::Target::TiedGrads,
                        ..
                    }
                )
            })
        });
        assert!(tied, "{cfg}: the tied table is summed between stages");
        check(&gpt2, cfg, p);
    }
}

/// ZeRO-3 on the device interpreter: each segment copy's weights gathered before
/// its forward and backward, its gradients reduce-scattered after the backward, each
/// rank's AdamW on its part; with tensor and pipeline parallelism too.
#[test]
fn device_interpreter_runs_zero3_bit_for_bit() {
    let llama = model("tiny-gpt");
    for cfg in [
        "dp=2,zero=3",
        "dp=4,zero=3,mbs=1",
        "dp=2,zero=3,mbs=1,recompute=full",
        "dp=2,tp=2,sp=true,zero=3",
        "dp=2,pp=2,zero=3,mbs=1",
        "dp=2,tp=2,pp=2,sp=true,zero=3,mbs=1",
    ] {
        let p = plan(&llama, cfg);
        assert_eq!(p.strategy.zero, 3, "{cfg}");
        check(&llama, cfg, p);
    }
    let gpt2 = gpt2_like();
    check(&gpt2, "dp=2,zero=3", plan(&gpt2, "dp=2,zero=3"));
}

/// Context parallelism on the device interpreter: each rank's block of every
/// sequence, ring attention passing key/value blocks as device buffers and merging
/// by log-sum-exp, the blocks' gradients sent back to their owners; with data,
/// tensor and pipeline parallelism and ZeRO too.
/// Between steps a ZeRO-3 rank holds its part of each segment copy's fp32 masters
/// and of their moments, nothing whole: the whole weights live from a copy's gather
/// to the end of its forward or backward, their gradients during the backward. A
/// ZeRO-2 rank holds whole masters and its part of the moments, and gradients only
/// while a micro-batch's backward writes them.
#[test]
fn zero_ranks_hold_only_their_parts_between_steps() {
    let opts = TrainOptions::default();
    let state = |m: &Model, cfg: &str| {
        let run = train_device(&plan(m, cfg), &opts, &|_| Ok(HostDevice)).expect(cfg);
        let r = &run.ranks[0];
        (
            r.state_bytes,
            r.weights.values().map(Vec::len).sum::<usize>(),
        )
    };
    // tiny-gpt by hand: token table 256 x 64; a layer's two norms 2 x 64, q 64 x 64,
    // k and v 2 x 64 x 32, output 64 x 64, up 64 x 256, down 128 x 64: 36,992;
    // the final norm 64 and an untied head 64 x 256.
    let llama = model("tiny-gpt");
    let (whole, p) = state(&llama, "dp=2");
    assert_eq!(p, 16_384 + 2 * 36_992 + 64 + 16_384);
    // Replicated: fp32 master, gradient and two moments, 16 bytes a parameter.
    assert_eq!(whole, 16.0 * p as f64);
    // ZeRO-3 over 2: half of the masters and of the moments, 12 / 2 bytes.
    let (z3, p3) = state(&llama, "dp=2,zero=3");
    assert_eq!(p3, p, "the report gathers the weights whole");
    assert_eq!(z3, 6.0 * p as f64);
    // GPT-2's layout: the tied table is read by the embedding and by the head, so
    // it stays whole with its gradient (8 bytes an element) besides its share of
    // the parts. A layer: norms 4 x 64, qkv 64 x 192 + 192, output 64 x 64 + 64, up
    // 64 x 128 + 128, down 128 x 64 + 64: 33,472; positions 32 x 64, final norm 128.
    let (z3, p) = state(&gpt2_like(), "dp=2,zero=3");
    assert_eq!(p, 16_384 + 2_048 + 2 * 33_472 + 128);
    assert_eq!(z3, 6.0 * p as f64 + 8.0 * 16_384.0);
    // ZeRO-1 over 2: whole masters and gradients, half the moments, 4 + 4 + 8 / 2
    // bytes. ZeRO-2 scatters every micro-batch's gradients (4 of them here: 8
    // sequences over 2 ranks) and holds none whole between micro-batches or steps:
    // 4 + 8 / 2. Its first micro-batch's gradients are the step's only ones when
    // there is one micro-batch, so the two runs then train alike bit for bit.
    let llama = model("tiny-gpt");
    let p = 16_384 + 2 * 36_992 + 64 + 16_384;
    let (z1, _) = state(&llama, "dp=2,zero=1");
    let (z2, _) = state(&llama, "dp=2,zero=2");
    assert_eq!((z1, z2), (12.0 * p as f64, 8.0 * p as f64));
    let run = |cfg: &str| train_device(&plan(&llama, cfg), &opts, &|_| Ok(HostDevice)).expect(cfg);
    let (a, b) = (run("dp=2,zero=1,mbs=4"), run("dp=2,zero=2,mbs=4"));
    assert_eq!(a.losses, b.losses);
    assert!(a
        .ranks
        .iter()
        .zip(&b.ranks)
        .all(|(x, y)| x.weights == y.weights));
    let (a, b) = (run("dp=2,zero=1,mbs=1"), run("dp=2,zero=2,mbs=1"));
    assert_ne!(
        a.losses, b.losses,
        "summed in another order, not bit for bit"
    );
}

/// The plan's model states and data-parallel bytes are what the ranks hold and
/// send, in fp32 on the host device and for a bf16 model on the device that rounds
/// as a GPU does (`Bf16Host`): meshplan's executor keeps a bf16 compute copy, fp32
/// masters (partitioned under ZeRO, as Megatron-LM's distributed optimizer does),
/// fp32 gradients, reduces the gradients at 4 bytes an element whatever the
/// model's dtype and gathers compute copies. Between steps a rank has let go of
/// what the plan counts at its peak: the gradient parts under ZeRO 2-3.
#[test]
fn model_states_and_gradient_bytes_are_what_the_plan_predicts() {
    use meshplan_executor::device::emulate::Bf16Host;
    let opts = TrainOptions {
        steps: 1,
        ..TrainOptions::default()
    };
    let bf16 = variant(&[("dtype: f32", "dtype: bf16")], "bf16.yaml");
    // tiny-gpt's parameters, counted in `zero_ranks_hold_only_their_parts_between_steps`.
    let p = (16_384 + 2 * 36_992 + 64 + 16_384) as f64;
    for (m, wide) in [(model("tiny-gpt"), true), (bf16, false)] {
        for zero in 0..=3u8 {
            let cfg = format!("dp=2,mbs=1,zero={zero}");
            let pl = plan(&m, &cfg);
            let run = if wide {
                train_device(&pl, &opts, &|_| Ok(HostDevice))
            } else {
                train_device(&pl, &opts, &|_| Ok(Bf16Host))
            }
            .unwrap_or_else(|e| panic!("{cfg}: {e}"));
            let mem = &pl.predicted["memory_per_gpu_bytes"];
            let [params, grads, optimizer] =
                ["params", "grads", "optimizer"].map(|k| mem[k].as_f64().expect(k));
            // Per parameter, by hand: fp32 4 + 4 + 8, bf16 2 + 4 + (4 + 8), the
            // optimizer's over the 2 data ranks from ZeRO-1, the gradients' from
            // ZeRO-2, the compute copy's at ZeRO-3.
            let by_hand = match (wide, zero) {
                (true, 0) => [4.0, 4.0, 8.0],
                (true, 1) => [4.0, 4.0, 4.0],
                (true, 2) => [4.0, 2.0, 4.0],
                (true, _) => [2.0, 2.0, 4.0],
                (false, 0) => [2.0, 4.0, 12.0],
                (false, 1) => [2.0, 4.0, 6.0],
                (false, 2) => [2.0, 2.0, 6.0],
                (false, _) => [1.0, 2.0, 6.0],
            };
            assert_eq!([params, grads, optimizer], by_hand.map(|b| b * p), "{cfg}");
            let held = match zero {
                0 | 1 => params + grads + optimizer,
                _ => params + optimizer,
            };
            for r in &run.ranks {
                assert_eq!(r.state_bytes, held, "{cfg}, wide {wide}: rank {}", r.rank);
            }
            // One step of 4 micro-batches a rank: ZeRO-0 sums the fp32 gradients
            // once, 2 (n - 1) / n x 4 P = 4 P bytes over 2 ranks; ZeRO-1 scatters
            // them, (n - 1) / n x 4 P = 2 P, and gathers the compute copies, P in
            // bf16 (2 P in fp32); ZeRO-2 scatters every micro-batch's, 4 x 2 P,
            // and gathers once; ZeRO-3 gathers the compute copies twice and
            // scatters the gradients once per micro-batch: 4 x (2 x 1 + 2) P in
            // bf16, 4 x 3 x 2 P in fp32.
            let dp = match wide {
                true => [4.0, 4.0, 10.0, 24.0],
                false => [4.0, 3.0, 9.0, 16.0],
            }[zero as usize]
                * p;
            assert_eq!(
                run.ranks[0].counts.axis_bytes_sent("dp"),
                dp,
                "{cfg}, wide {wide}"
            );
            let bytes = byte_mismatches(&pl, &run, opts.steps);
            assert!(bytes.is_empty(), "{cfg}: {}", bytes.join("\n"));
        }
    }
}

/// On the device that rounds as a GPU does, a bf16 model trains bit for bit alike
/// at every ZeRO stage over 2 data ranks with one micro-batch each (2 ranks sum
/// each element in one order whatever the collective): ZeRO 1-3 update each rank's
/// part of the fp32 masters and bring the other parts' compute copies. A ZeRO-1
/// rank's checkpoint, saved from its part, resumes bit for bit, and at ZeRO-3.
#[test]
fn a_bf16_model_trains_alike_at_every_zero_stage_and_resumes_from_its_parts() {
    use meshplan_executor::ckpt::{Checkpoint, SaveOptions};
    use meshplan_executor::device::emulate::Bf16Host;
    let bf16 = ("dtype: f32", "dtype: bf16");
    let run = |m: &Model, cfg: &str, o: &TrainOptions| {
        train_device(&plan(m, cfg), o, &|_| Ok(Bf16Host)).unwrap_or_else(|e| panic!("{cfg}: {e}"))
    };
    let opts = TrainOptions::default();
    for m in [
        variant(&[bf16], "bf16.yaml"),
        gpt2_like_with(Some(bf16), "gpt2-bf16.yaml"),
    ] {
        let base = run(&m, "dp=2,mbs=4,zero=0", &opts);
        for zero in 1..=3 {
            let cfg = format!("dp=2,mbs=4,zero={zero}");
            let r = run(&m, &cfg, &opts);
            assert_eq!(r.losses, base.losses, "{cfg}: losses");
            for (x, y) in r.ranks.iter().zip(&base.ranks) {
                assert!(x.weights == y.weights, "{cfg}: rank {} weights", x.rank);
            }
        }
    }
    let m = variant(&[bf16], "bf16.yaml");
    for cfg in ["dp=2,mbs=4,zero=1", "dp=2,mbs=4,zero=3"] {
        let dir = std::env::temp_dir().join(format!(
            "meshplan-zero-bf16-{}-{}",
            std::process::id(),
            cfg.replace(['=', ','], "-")
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let saving = TrainOptions {
            steps: 3,
            save: Some(SaveOptions::new(&dir, 3)),
            ..TrainOptions::default()
        };
        run(&m, cfg, &saving);
        let ck = Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}"));
        let resumed = TrainOptions {
            steps: 6,
            resume: Some(std::sync::Arc::new(ck)),
            ..TrainOptions::default()
        };
        let (a, b) = (
            run(&m, cfg, &resumed),
            run(
                &m,
                cfg,
                &TrainOptions {
                    steps: 6,
                    ..TrainOptions::default()
                },
            ),
        );
        assert_eq!(a.losses[..], b.losses[3..], "{cfg}: resumed losses");
        for (x, y) in a.ranks.iter().zip(&b.ranks) {
            assert!(
                x.weights == y.weights,
                "{cfg}: rank {} resumed weights",
                x.rank
            );
        }
    }
}

/// Under ZeRO each rank gathers the parts it updated, so a plan's parameter gathers
/// must cut the flat vector where its reduce-scatters do. Hand-edited to one gather
/// of the whole set after 4 reduce-scatters, a plan trained on silently (its losses
/// left ZeRO-0's from the second step, on the host device as on the one that rounds
/// as a GPU does); it is refused, naming both cuts, before any rank starts.
#[test]
fn parameter_gathers_cut_elsewhere_than_the_gradient_buckets_are_refused() {
    use meshplan_executor::device::emulate::Bf16Host;
    use meshplan_ir::plan::{CollectiveKind, Instr, Target};
    let m = variant(&[("dtype: f32", "dtype: bf16")], "bf16.yaml");
    let opts = TrainOptions::default();
    let good = plan_buckets(&m, "dp=2,mbs=4,zero=1", 30_000.0);
    supported(&good).expect("the planner's cuts");
    let mut p = good.clone();
    let (mut scatters, mut gathers) = (0, 0);
    for phase in p.programs.iter_mut().flat_map(|g| &mut g.phases) {
        let mut kept = false;
        phase.step.retain_mut(|i| match i {
            Instr::Collective {
                kind: CollectiveKind::AllGather,
                target: Target::ParamBucket { range, .. },
                ..
            } => {
                *range = None;
                gathers += 1;
                !std::mem::replace(&mut kept, true)
            }
            Instr::Collective {
                kind: CollectiveKind::ReduceScatter,
                ..
            } => {
                scatters += 1;
                true
            }
            _ => true,
        });
    }
    assert_eq!((scatters, gathers), (4, 4), "one program, 4 buckets");
    let why = supported(&p).expect_err("cut elsewhere");
    assert!(
        why.contains("parameter gathers (params:dense)")
            && why.contains("grads:dense[0..30000], grads:dense[30000..60000]"),
        "{why}"
    );
    for run in [
        train_device(&p, &opts, &|_| Ok(HostDevice)),
        train_device(&p, &opts, &|_| Ok(Bf16Host)),
    ] {
        let e = run.expect_err("refused").message().to_string();
        assert!(e.contains("do not cut the flat vector"), "{e}");
    }
}

/// Every fp32 collective of a bf16 model counts at 4 bytes an element, as the plan
/// prices it: a tied table summed between the first and last stage, sequence
/// parallelism's partial norm gradients (once a step, per micro-batch under ZeRO-2,
/// per segment copy under ZeRO-3) and gradient buckets; ZeRO's gathers of compute
/// copies at 2.
#[test]
fn a_bf16_models_fp32_sums_are_priced_and_counted_alike() {
    use meshplan_executor::device::emulate::Bf16Host;
    let opts = TrainOptions {
        steps: 1,
        ..TrainOptions::default()
    };
    let m = variant(
        &[
            ("dtype: f32", "dtype: bf16"),
            ("tie_embeddings: false", "tie_embeddings: true"),
        ],
        "tied-bf16.yaml",
    );
    for cfg in [
        "dp=2,tp=2,pp=2,mbs=1,sp=true,zero=1",
        "dp=2,tp=1,pp=2,mbs=1,zero=0",
        "dp=2,tp=2,mbs=1,sp=true,zero=2",
        "dp=2,tp=2,mbs=1,sp=true,zero=3",
    ] {
        let p = plan(&m, cfg);
        let run =
            train_device(&p, &opts, &|_| Ok(Bf16Host)).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        let bytes = byte_mismatches(&p, &run, opts.steps);
        assert!(bytes.is_empty(), "{cfg}: {}", bytes.join("\n"));
    }
}

#[test]
fn device_interpreter_runs_context_parallel_plans_bit_for_bit() {
    let llama = model("tiny-gpt");
    for cfg in [
        "cp=2",
        "cp=4,mbs=1",
        "dp=2,cp=2,recompute=full",
        "tp=2,cp=2,sp=true",
        "dp=2,cp=2,zero=3",
        "cp=2,pp=2,mbs=1",
    ] {
        let p = plan(&llama, cfg);
        assert!(p.strategy.cp > 1, "{cfg}");
        check(&llama, cfg, p);
    }
    let gpt2 = gpt2_like();
    check(
        &gpt2,
        "cp=2,tp=2,sp=false",
        plan(&gpt2, "cp=2,tp=2,sp=false"),
    );
}

#[test]
fn device_interpreter_runs_routed_experts_bit_for_bit() {
    // Dropless and capacity routing; experts replicated, split over ep (tokens
    // exchanged by All-to-All with the routed counts) and over tp (with and without
    // sequence parallelism); with ZeRO, pipeline stages and context blocks.
    let moe = model("tiny-moe");
    for cfg in [
        "dp=1",
        "dp=2",
        "dp=2,ep=2",
        "tp=2",
        "tp=2,sp=true",
        "tp=2,ep=2,sp=true",
        "dp=2,ep=2,zero=1",
        "dp=4,ep=2,zero=2,mbs=1",
        "dp=2,ep=2,pp=2,mbs=1",
        "dp=2,ep=2,recompute=full",
        // ZeRO-3: the experts' set sharded over edp, the rest over dp.
        "dp=4,ep=2,zero=3,mbs=1",
        "dp=2,zero=3",
    ] {
        check(&moe, cfg, plan(&moe, cfg));
    }
    let cap = model("tiny-moe-capacity");
    for cfg in [
        "dp=2",
        "dp=2,ep=2",
        "cp=2,ep=2",
        "tp=2",
        "tp=2,sp=true",
        "dp=2,tp=2,ep=4,sp=true",
        "tp=2,ep=2,sp=true,pp=2,mbs=1",
        "dp=4,ep=2,zero=3,mbs=1",
    ] {
        check(&cap, cfg, plan(&cap, cfg));
    }
    // The capacity drops some assignments, and both interpreters count the same.
    let p = plan(&cap, "dp=2,ep=2");
    let opts = TrainOptions::default();
    let run = train_device(&p, &opts, &|_| Ok(HostDevice)).unwrap();
    let (slots, dropped) = run.ranks.iter().fold((0, 0), |a, r| {
        (a.0 + r.expert_slots.0, a.1 + r.expert_slots.1)
    });
    assert!(dropped > 0 && dropped < slots / 2, "{dropped} of {slots}");
}

#[test]
fn device_interpreter_names_what_it_does_not_run() {
    // Inference plans run on the inference interpreter.
    let m = model("tiny-llama-inference");
    let p = plan(&m, "dp=1");
    let e = supported(&p).expect_err("inference");
    assert!(e.contains("not a training plan"), "{e}");
    let run = train_device(&p, &TrainOptions::default(), &|_| Ok(HostDevice)).expect_err("run");
    assert!(
        run.message().contains("not a training plan"),
        "{}",
        run.message()
    );
}

#[test]
fn device_interpreter_runs_dropout_bit_for_bit() {
    // Residual and attention-probability dropout, drawn from global coordinates:
    // every split of samples, heads, positions and stages, and recomputation,
    // drops what the general interpreter drops.
    let dropout = with_dropout();
    assert!(dropout.graph.constants.dropout_p > 0.0);
    for cfg in [
        "dp=1",
        "dp=2",
        "tp=2,sp=false",
        "tp=2,sp=true",
        "cp=2",
        "dp=2,tp=2,pp=2,mbs=1",
        "tp=2,cp=2,recompute=full",
        "dp=2,recompute=selective",
        "dp=2,tp=2,sp=true,mbs=2",
        "dp=2,zero=3",
    ] {
        check(&dropout, cfg, plan(&dropout, cfg));
    }
    let gpt2 = crate::matrix::variant(
        "tiny-gpt",
        &[
            ("mlp: swiglu", "mlp: gelu"),
            ("norm: rmsnorm", "norm: layernorm\n  bias: true"),
            ("tie_embeddings: false", "tie_embeddings: true"),
            (
                "position: rope",
                "position: learned\n  max_positions: 32\n  dropout: true",
            ),
            ("kv_heads: 2", "kv_heads: 4"),
        ],
        "gpt2-dropout.yaml",
    );
    for cfg in ["dp=2,tp=2,sp=true,mbs=1", "pp=2,mbs=1"] {
        check(&gpt2, cfg, plan(&gpt2, cfg));
    }
    // The masks are not the identity: the first loss moves off the same model's
    // without dropout.
    let opts = TrainOptions::default();
    let on = train_device(&plan(&dropout, "dp=2"), &opts, &|_| Ok(HostDevice)).unwrap();
    let off = train_device(&plan(&model("tiny-gpt"), "dp=2"), &opts, &|_| {
        Ok(HostDevice)
    })
    .unwrap();
    assert!(
        (on.losses[0] - off.losses[0]).abs() > 1e-4 * off.losses[0],
        "{} vs {}",
        on.losses[0],
        off.losses[0]
    );
}

#[test]
fn device_trace_spans_are_on_the_run_clock() {
    let m = model("tiny-gpt");
    let p = plan(&m, "dp=2");
    let opts = TrainOptions {
        steps: 2,
        trace: true,
        ..TrainOptions::default()
    };
    let run = train_device(&p, &opts, &|_| Ok(HostDevice)).expect("run");
    for r in &run.ranks {
        let names: Vec<&str> = r.spans.iter().map(|s| s.name.as_str()).collect();
        for want in ["fwd mb0 c0", "bwd mb0 c0", "optimizer", "AllReduce dp"] {
            assert!(
                names.contains(&want),
                "rank {}: no `{want}` in {names:?}",
                r.rank
            );
        }
        let total: f64 = run.step_s.iter().sum();
        for s in &r.spans {
            assert!(s.dur_s >= 0.0 && s.start_s >= 0.0, "{s:?}");
            assert!(s.dur_s <= total + 1e-3, "{s:?} longer than the run");
        }
        // Ops nest inside their task.
        let task = r
            .spans
            .iter()
            .find(|s| s.name == "fwd mb0 c0")
            .expect("task");
        let op = r.spans.iter().find(|s| {
            s.cat == "compute" && s.start_s >= task.start_s && s.start_s < task.start_s + task.dur_s
        });
        assert!(op.is_some(), "no op inside the first forward task");
    }
}

/// The bf16-emulating host device against the fp32 reference: how far mixed
/// precision moves a run, which is what `run --check` on a GPU allows; a 1.5x
/// learning rate is refused (`matrix::check_bf16`, which the bf16 mode matrix
/// runs on every configuration of its covering).
#[test]
fn mixed_precision_stays_within_the_check_tolerances_and_a_wrong_run_does_not() {
    for (m, cfg) in [
        (model("tiny-gpt"), "dp=1"),
        (model("tiny-gpt"), "dp=2,mbs=1"),
        (gpt2_like(), "dp=2"),
        (model("tiny-gpt"), "dp=2,tp=2,sp=false"),
        (gpt2_like(), "tp=2,sp=false"),
        (model("tiny-gpt"), "dp=2,tp=2,sp=true"),
        (model("tiny-gpt"), "dp=2,tp=2,pp=2,mbs=1,sp=true"),
        (model("tiny-gpt"), "dp=2,zero=3"),
        (model("tiny-gpt"), "dp=2,tp=2,pp=2,sp=true,zero=3,mbs=1"),
        (model("tiny-gpt"), "dp=2,cp=2"),
        (with_dropout(), "dp=2,tp=2,sp=true"),
        (model("tiny-moe"), "dp=2,ep=2"),
        (model("tiny-moe-capacity"), "dp=2,ep=2"),
    ] {
        crate::matrix::check_bf16(&m, cfg, &plan(&m, cfg));
    }
}

/// Gradient buckets start as soon as the step's last backward has finished their
/// gradients, not after it: on a device with its own collective engine that is the
/// overlap of communication with the backward.
#[test]
fn gradient_buckets_start_during_the_last_backward() {
    let m = model("tiny-gpt");
    let p = plan_buckets(&m, "dp=2,mbs=2", 10_000.0);
    let opts = TrainOptions {
        steps: 1,
        trace: true,
        ..TrainOptions::default()
    };
    let run = train_device(&p, &opts, &|_| Ok(HostDevice)).expect("run");
    let spans = &run.ranks[0].spans;
    let last_bwd = spans
        .iter()
        .filter(|s| s.name.starts_with("bwd "))
        .max_by(|a, b| a.start_s.total_cmp(&b.start_s))
        .expect("a backward task");
    let end = last_bwd.start_s + last_bwd.dur_s;
    let early: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "AllReduce dp (start)")
        .collect();
    let during = early
        .iter()
        .filter(|s| s.start_s >= last_bwd.start_s && s.start_s + s.dur_s <= end + 1e-9)
        .count();
    let buckets = spans.iter().filter(|s| s.name == "AllReduce dp").count();
    eprintln!(
        "{buckets} buckets, {} started early, {during} inside the last backward",
        early.len()
    );
    assert!(buckets > 5, "{buckets}");
    // All but the bucket holding the embedding table (whose gradient is the last
    // one written) start inside the backward.
    assert!(
        during + 1 >= buckets,
        "{during} of {buckets} started during the backward"
    );
    // The first micro-batch's backward starts none: its gradients are not final.
    let first_bwd = spans
        .iter()
        .filter(|s| s.name.starts_with("bwd "))
        .min_by(|a, b| a.start_s.total_cmp(&b.start_s))
        .expect("a backward task");
    assert!(early
        .iter()
        .all(|s| s.start_s >= first_bwd.start_s + first_bwd.dur_s));
}

/// The mixed-precision check compares a sharded rank with the same slice of the
/// reference: an fp32 tensor- and pipeline-parallel run passes it at a distance of
/// almost nothing, and a wrong one does not.
#[test]
fn mixed_precision_check_slices_sharded_weights() {
    use meshplan_executor::device::{
        check_mixed_precision, MIXED_LOSS_TOLERANCE, MIXED_UPDATE_TOLERANCE,
    };
    let m = model("tiny-gpt");
    let opts = TrainOptions::default();
    let p = plan(&m, "dp=2,tp=2,pp=2,mbs=1");
    let run = train(&p, &opts).expect("run");
    let reference = train(&plan(&m, "dp=1,mbs=1"), &opts.reference_of(&p)).expect("reference");
    let lines = check_mixed_precision(
        &p,
        &run,
        &reference,
        &opts,
        MIXED_LOSS_TOLERANCE,
        MIXED_UPDATE_TOLERANCE,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let last = lines.last().unwrap();
    eprintln!("{last}");
    assert!(last.contains("weights 0.00"), "{last}");
    let wrong = train(
        &p,
        &TrainOptions {
            lr: opts.lr * 1.5,
            ..opts.clone()
        },
    )
    .expect("run");
    check_mixed_precision(
        &p,
        &wrong,
        &reference,
        &opts,
        MIXED_LOSS_TOLERANCE,
        MIXED_UPDATE_TOLERANCE,
    )
    .expect_err("a 1.5x learning rate passes");
}

/// Ranks over given communicators (how one process drives several GPUs with NCCL)
/// train exactly as over the in-process world `train_device` makes.
#[test]
fn given_communicators_train_like_the_in_process_world() {
    use meshplan_executor::comm::{Communicator, ThreadComm};
    use meshplan_executor::device::train::train_device_with;
    let m = model("tiny-gpt");
    let p = plan(&m, "dp=2,mbs=1");
    let opts = TrainOptions::default();
    let over = |n: usize| {
        let comms: Vec<Box<dyn Communicator>> = ThreadComm::create(n, opts.timeout)
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator>)
            .collect();
        train_device_with(&p, &opts, &|_| Ok(HostDevice), Some(comms))
    };
    let with = over(2).expect("run");
    let world = train_device(&p, &opts, &|_| Ok(HostDevice)).expect("run");
    same("given communicators", &with, &world);
    let e = over(1).expect_err("one communicator for two ranks");
    assert!(
        e.message()
            .contains("1 communicators for a plan of 2 ranks"),
        "{}",
        e.message()
    );
}

/// A communicator whose sends complete only once their receive has taken them, as
/// NCCL's may: each message is acknowledged, on a world of its own so that the
/// acknowledgements neither mix with the data nor count as its bytes. An exchange
/// posts its sends and receives before it waits for any acknowledgement, as one
/// NCCL group does.
struct Rendezvous {
    data: ThreadComm,
    acks: ThreadComm,
}

type CResult = Result<(), meshplan_executor::comm::CommError>;

impl Rendezvous {
    fn world(n: usize, timeout: Option<std::time::Duration>) -> Vec<Box<dyn Communicator>> {
        let acks = ThreadComm::create(n, timeout);
        ThreadComm::create(n, timeout)
            .into_iter()
            .zip(acks)
            .map(|(data, acks)| Box::new(Rendezvous { data, acks }) as Box<dyn Communicator>)
            .collect()
    }
}

impl Communicator for Rendezvous {
    fn rank(&self) -> usize {
        self.data.rank()
    }
    fn world(&self) -> usize {
        self.data.world()
    }
    fn all_reduce(&mut self, g: &Group, axis: &str, buf: &mut [f32]) -> CResult {
        self.data.all_reduce(g, axis, buf)
    }
    fn all_gather(&mut self, g: &Group, axis: &str, x: &[f32], out: &mut [f32]) -> CResult {
        self.data.all_gather(g, axis, x, out)
    }
    fn reduce_scatter(&mut self, g: &Group, axis: &str, x: &[f32], out: &mut [f32]) -> CResult {
        self.data.reduce_scatter(g, axis, x, out)
    }
    fn broadcast(&mut self, g: &Group, axis: &str, buf: &mut [f32], root: usize) -> CResult {
        self.data.broadcast(g, axis, buf, root)
    }
    fn all_to_all(&mut self, g: &Group, axis: &str, x: &[f32], out: &mut [f32]) -> CResult {
        self.data.all_to_all(g, axis, x, out)
    }
    fn all_to_all_v(
        &mut self,
        g: &Group,
        axis: &str,
        x: &[f32],
        xc: &[usize],
        out: &mut [f32],
        oc: &[usize],
    ) -> CResult {
        self.data.all_to_all_v(g, axis, x, xc, out, oc)
    }
    fn send(&mut self, peer: usize, axis: &str, buf: &[f32]) -> CResult {
        self.p2p_group(axis, &[(peer, buf)], &mut [])
    }
    fn recv(&mut self, peer: usize, axis: &str, buf: &mut [f32]) -> CResult {
        self.p2p_group(axis, &[], &mut [(peer, buf)])
    }
    fn p2p_group(
        &mut self,
        axis: &str,
        sends: &[(usize, &[f32])],
        recvs: &mut [(usize, &mut [f32])],
    ) -> CResult {
        for (to, x) in sends {
            self.data.send(*to, axis, x)?;
        }
        for (from, x) in recvs.iter_mut() {
            self.data.recv(*from, axis, x)?;
            self.acks.send(*from, "ack", &[0.0])?;
        }
        for (to, _) in sends {
            self.acks.recv(*to, "ack", &mut [0.0])?;
        }
        Ok(())
    }
    fn barrier(&mut self, g: &Group) -> CResult {
        self.data.barrier(g)
    }
    fn counts(&self) -> ByteCounts {
        self.data.counts()
    }
    fn abort_handle(&self) -> AbortHandle {
        let (data, acks) = (self.data.abort_handle(), self.acks.abort_handle());
        AbortHandle::new(move |rank, reason| {
            data.abort(rank, reason.clone());
            acks.abort(rank, reason)
        })
    }
}

/// Pipeline schedules over sends that wait for their receives (NCCL's semantics).
/// In 1F1B's steady state each stage sends before it receives, and an interleaved
/// schedule's warm-up overlaps its chunks' sends; a rank that sent each boundary on
/// its own would wait on a neighbour waiting on it. The boundaries go at the
/// schedule's exchange points instead, and every schedule completes, training bit
/// for bit as over the queued sends of the in-process communicator, bytes included.
#[test]
fn pipeline_schedules_complete_when_sends_wait_for_their_receives() {
    use meshplan_executor::device::train::train_device_with;
    let llama = model("tiny-gpt");
    let eight = crate::matrix::variant("tiny-gpt", &[("layers: 2", "layers: 8")], "eight.yaml");
    let cases = [
        (&llama, "pp=2,mbs=1"),
        (&llama, "pp=2,mbs=4"),
        (&llama, "pp=2,mbs=1,schedule=gpipe"),
        (&llama, "tp=2,pp=2,mbs=1,sp=false"),
        (&llama, "dp=2,tp=2,pp=2,mbs=1,sp=true"),
        (&eight, "pp=4,mbs=1"),
        (&eight, "pp=4,mbs=2"),
        (&eight, "pp=4,mbs=1,schedule=gpipe"),
        (&eight, "pp=2,vpp=2,mbs=1"),
        (&eight, "pp=2,vpp=2,mbs=2"),
        (&eight, "pp=2,vpp=4,mbs=1"),
        (&eight, "pp=4,vpp=2,mbs=1"),
        (&eight, "pp=4,vpp=2,mbs=2"),
    ];
    let opts = TrainOptions {
        timeout: Some(std::time::Duration::from_secs(30)),
        ..TrainOptions::default()
    };
    for (m, cfg) in cases {
        let p = plan(m, cfg);
        let queued =
            train_device(&p, &opts, &|_| Ok(HostDevice)).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        let run = train_device_with(
            &p,
            &opts,
            &|_| Ok(HostDevice),
            Some(Rendezvous::world(p.ranks.len(), opts.timeout)),
        )
        .unwrap_or_else(|e| panic!("{cfg}: over sends that wait for their receives: {e}"));
        same(cfg, &run, &queued);
    }
}

/// What crosses between the host and the device in a run of the host device: the
/// uploads and downloads a GPU run would make, counted by [`Crossing`].
pub(crate) mod crossings {
    use meshplan_executor::device::train::train_device;
    use meshplan_executor::device::{Crossing, HostPrecision};
    use meshplan_executor::train::TrainOptions;
    use meshplan_ir::plan::Plan;
    use std::collections::BTreeMap;
    use std::sync::{Mutex, PoisonError};

    /// Calls and elements of each crossing.
    pub(crate) type Ledger = BTreeMap<Crossing, (u64, u64)>;

    static LEDGER: Mutex<Ledger> = Mutex::new(BTreeMap::new());
    /// One audited run at a time: the ledger is the process's.
    static ONE_RUN: Mutex<()> = Mutex::new(());

    /// The fp32 host device, counting each crossing's calls and elements.
    #[derive(Clone, Copy, Default)]
    pub(crate) struct Audited;

    impl HostPrecision for Audited {
        const ACT_BYTES: usize = 4;
        fn round(_: &mut [f32]) {}
        fn crossed(what: Crossing, elems: usize) {
            let mut l = LEDGER.lock().unwrap_or_else(PoisonError::into_inner);
            let e = l.entry(what).or_default();
            *e = (e.0 + 1, e.1 + elems as u64);
        }
    }

    /// What `run(a)` moves (on [`Audited`]), and what each unit of `run(b)` beyond
    /// it adds, one audited run at a time. Every unit after the `a`-th must add the
    /// same: a difference that the units do not divide fails.
    fn beyond(run: &dyn Fn(u64), (a, b): (u64, u64)) -> (Ledger, Ledger) {
        let _one = ONE_RUN.lock().unwrap_or_else(PoisonError::into_inner);
        let ledger = || LEDGER.lock().unwrap_or_else(PoisonError::into_inner);
        let [base, more] = [a, b].map(|n| {
            ledger().clear();
            run(n);
            std::mem::take(&mut *ledger())
        });
        let units = b - a;
        let mut per = BTreeMap::new();
        for (what, (calls, elems)) in more {
            let (c0, e0) = base.get(&what).copied().unwrap_or_default();
            let d = (calls - c0, elems - e0);
            assert!(
                d.0 % units == 0 && d.1 % units == 0,
                "{what:?}: {d:?} over {units} units"
            );
            if d != (0, 0) {
                per.insert(what, (d.0 / units, d.1 / units));
            }
        }
        (base, per)
    }

    /// What a generation of 3 new tokens per request moves, and what each token
    /// after them adds (from one of 7): `generate(n)` generates `n`.
    pub(crate) fn per_token(generate: &dyn Fn(u64)) -> (Ledger, Ledger) {
        beyond(generate, (3, 7))
    }

    /// Calls and elements of each crossing in one step after the first (from
    /// runs of 1 and 3 steps).
    pub(crate) fn per_step(p: &Plan) -> Ledger {
        let run = |steps| {
            let opts = TrainOptions {
                steps,
                ..TrainOptions::default()
            };
            train_device(p, &opts, &|_| Ok(Audited)).expect("run");
        };
        beyond(&run, (1, 3)).1
    }
}

/// A step of the device interpreter keeps its work on the device: on every mode,
/// what a step after the first moves between the host and the device (counted on
/// the host device, where a GPU run would cross the bus) is its batch's tokens and
/// labels going up, each token's loss coming back once (in one read back a rank),
/// and one finiteness flag a rank; routed experts add their routing's round trip
/// (the counts, which size the All-to-All-v, and the indices made from them). No
/// weight, activation, gradient or constant goes through the host.
#[test]
fn a_step_moves_only_its_batch_its_losses_and_a_flag_across_the_bus() {
    use meshplan_executor::device::Crossing::{self, *};
    use meshplan_ir::Workload;
    let batch_only =
        |p: &Plan, cfg: &str, got: &std::collections::BTreeMap<Crossing, (u64, u64)>| {
            let s = &p.strategy;
            let Workload::Train {
                seq_len,
                global_batch,
                ..
            } = p.workload
            else {
                unreachable!()
            };
            let world = p.ranks.len() as u64;
            // Each rank's micro-batches: its context block of `mbs` sequences, tokens
            // and labels, and this tensor rank's block of the tokens under sequence
            // parallelism.
            let rows = seq_len / s.cp * s.mbs;
            let block = if s.sp && s.tp > 1 { rows / s.tp } else { 0 };
            let batch = world * global_batch / (s.dp * s.mbs) * (2 * rows + block);
            let tokens = seq_len * global_batch;
            assert_eq!(got.get(&IdsUp).map(|c| c.1), Some(batch), "{cfg}: {got:?}");
            assert_eq!(
                got.get(&F32Down).map(|c| c.1),
                Some(tokens),
                "{cfg}: {got:?}"
            );
            // In one read back a rank, whatever its micro-batches.
            assert!(got[&F32Down].0 <= world, "{cfg}: {got:?}");
            assert_eq!(got.get(&Flag), Some(&(world, world)), "{cfg}: {got:?}");
            assert_eq!(got.len(), 3, "{cfg}: {got:?}");
        };
    let llama = model("tiny-gpt");
    for cfg in [
        "dp=2",
        "tp=2,sp=true",
        "dp=2,tp=2,sp=false,recompute=selective",
        "pp=2,mbs=1",
        "pp=2,mbs=1,schedule=gpipe",
        "cp=2",
        "tp=2,cp=2,sp=true",
        "dp=2,zero=3",
        "dp=2,tp=2,pp=2,sp=true,zero=3,mbs=1",
        "dp=2,cp=2,recompute=full",
    ] {
        let p = plan(&llama, cfg);
        batch_only(&p, cfg, &crossings::per_step(&p));
    }
    let four = crate::executor::four_layers();
    let p = plan(&four, "pp=2,vpp=2,mbs=1");
    batch_only(&p, "pp=2,vpp=2", &crossings::per_step(&p));
    // GPT-2's layout: learned positions looked up by each rank's block, biases, a
    // tied table summed between stages; and a padded vocabulary masked in the loss.
    let gpt2 = gpt2_like();
    for cfg in ["tp=2,sp=true", "dp=2,tp=2,pp=2,mbs=1,sp=true"] {
        let p = plan(&gpt2, cfg);
        batch_only(&p, cfg, &crossings::per_step(&p));
    }
    let padded = variant(
        &[
            (
                "vocab: 256",
                "vocab: 250\n  make_vocab_size_divisible_by: 64",
            ),
            ("tie_embeddings: false", "tie_embeddings: true"),
            ("kv_heads: 2", "kv_heads: 4"),
        ],
        "padded.yaml",
    );
    for cfg in ["dp=1", "tp=2,sp=true"] {
        let p = plan(&padded, cfg);
        batch_only(&p, cfg, &crossings::per_step(&p));
    }
    let p = plan(&with_dropout(), "dp=2");
    batch_only(&p, "dropout", &crossings::per_step(&p));
    // Routed experts: the counts (under a capacity, with each expert's kept
    // slots) come to the host once per layer and micro-batch, the exchange's
    // indices go up; the padding is placed on the device. Nothing else.
    for (m, cfg, kept) in [
        ("tiny-moe", "dp=2,ep=2", false),
        ("tiny-moe", "tp=2,ep=2,sp=true", false),
        ("tiny-moe-capacity", "dp=2,ep=2", true),
    ] {
        let p = plan(&model(m), cfg);
        let got = crossings::per_step(&p);
        assert_eq!(
            got.keys().copied().collect::<Vec<_>>(),
            vec![IdsUp, F32Down, Flag, ExpertCounts],
            "{m} {cfg}"
        );
        let layers: u64 = (p.graph.segments.iter())
            .map(|s| {
                let ops = s.ops.iter();
                let experts = ops.filter(|o| matches!(o.kind, meshplan_ir::OpKind::Experts(_)));
                experts.count() as u64 * s.repeat
            })
            .sum();
        let world = p.ranks.len() as u64;
        let mbs = world * 8 / (p.strategy.dp * p.strategy.mbs);
        assert_eq!(got[&ExpertCounts].0, layers * mbs, "{m} {cfg}: {got:?}");
        let e = (p.graph.ops())
            .find_map(|o| match &o.kind {
                meshplan_ir::OpKind::Experts(e) => Some(*e),
                _ => None,
            })
            .unwrap();
        let values = layers * mbs * e.experts * if kept { 2 } else { 1 };
        assert_eq!(got[&ExpertCounts].1, values, "{m} {cfg}: {got:?}");
        // Up: each micro-batch's tokens and labels (and its sequence-parallel
        // block), and per layer the exchange's two reorders; the routing's own
        // buffers are made on the device.
        let s = &p.strategy;
        let sp = u64::from(s.sp && s.tp > 1);
        let order = if s.ep > 1 { 2 * layers * mbs } else { 0 };
        assert_eq!(got[&IdsUp].0, mbs * (2 + sp) + order, "{m} {cfg}: {got:?}");
        if !kept {
            // Dropless, every slot is exchanged: each reorder holds a rank's
            // tokens times top-k.
            let Workload::Train { seq_len, .. } = p.workload else {
                unreachable!()
            };
            let rows = seq_len / s.cp * s.mbs;
            let batch = mbs * (2 * rows + sp * rows / s.tp);
            let local = if sp == 1 { rows / s.tp } else { rows };
            let reorders = 2 * layers * mbs * local * e.top_k;
            assert_eq!(got[&IdsUp].1, batch + reorders, "{m} {cfg}: {got:?}");
        }
    }
}
