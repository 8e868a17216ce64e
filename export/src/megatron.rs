//! Megatron-LM (`pretrain_gpt.py`) arguments: parallel degrees, batch, recomputation,
//! the distributed optimizer, and the model's shape.

use crate::{batch_refusal, even_split, train_shape, transformer, ArgList, Refusals, Target};
use meshplan_ir::plan::Plan;
use meshplan_ir::{DType, MlpKind, NormKind, PositionKind, Recompute, Schedule};

pub(crate) fn export(plan: &Plan) -> Result<String, crate::CannotExpress> {
    let mut r = Refusals::new(Target::Megatron);
    let c = &plan.strategy;
    let (seq, global_batch) = train_shape(plan);
    let t = transformer(plan, &mut r);
    let layers = plan.model.layers;

    if c.dp_attention {
        r.push("dp_attention is an inference layout; a training plan should not have it");
    }
    if c.pp > 1 && c.schedule == Schedule::Gpipe {
        r.push("Megatron-LM has no GPipe schedule (it runs 1F1B, or interleaved 1F1B with virtual stages); 1F1B has the same bubble and keeps fewer micro-batches' activations, so re-plan with --config schedule=1f1b to get the prediction it would run");
    }
    if c.vpp > 1 && !layers.is_multiple_of(c.pp * c.vpp) {
        r.push(format!(
            "--num-layers-per-virtual-pipeline-stage needs the {layers} layers to divide into pp({}) x vpp({}) equal chunks",
            c.pp, c.vpp
        ));
    }
    let split = &plan.layer_split;
    let mut first_last = None;
    if !even_split(plan) {
        let pp = c.pp as usize;
        let middle = &split[1..pp.saturating_sub(1).max(1)];
        let middle_even = middle.windows(2).all(|w| w[0] == w[1]);
        if c.vpp > 1 || split.len() != pp || !middle_even {
            r.push(format!(
                "the plan splits layers {split:?} over its pipeline chunks; Megatron-LM can only make the first and last stage differ (--decoder-first/last-pipeline-num-layers, without virtual stages): an even split would move the slowest stage's time, re-plan with an even split (--config vpp=1 and layers divisible by pp) or accept that the prediction no longer holds"
            ));
        } else {
            first_last = Some((split[0], split[pp - 1]));
        }
    }
    if let Some(why) = batch_refusal(plan, "Megatron-LM", global_batch) {
        r.push(why);
    }
    let vocab_divisor = t.and_then(|t| {
        // Megatron pads the vocabulary to a multiple of divisor x tp; pick the
        // divisor (the largest from the default 128, then the model's own over tp)
        // that gives the plan's rows: the vocabulary, padded as the model says.
        let rows = t.padded_vocab();
        let own = (t.make_vocab_size_divisible_by.is_multiple_of(c.tp))
            .then(|| t.make_vocab_size_divisible_by / c.tp);
        let d = [128u64, 64, 32, 16, 8, 4, 2, 1]
            .into_iter()
            .chain(own)
            .find(|d| t.vocab.next_multiple_of(d * c.tp) == rows);
        if d.is_none() {
            r.push(format!(
                "Megatron-LM pads the vocabulary to a multiple of the tensor-parallel size {}; {} would become {} rows, which the plan did not price (it has {rows}); plan with --make-vocab-size-divisible-by 128",
                c.tp,
                t.vocab,
                t.vocab.next_multiple_of(c.tp)
            ));
        }
        d
    });
    match plan.model.dtype {
        DType::Bf16 | DType::F16 | DType::F32 => {}
        d => r.push(format!(
            "the plan computes in {d:?}; exported Megatron-LM arguments cover bf16, fp16 and fp32 training"
        )),
    }
    if let Some(t) = t {
        if t.mla.is_some() && c.cp > 1 {
            r.push("multi-latent attention with context parallelism is not a combination Megatron-LM runs");
        }
        if t.position == PositionKind::Alibi
            && plan.workload.framework() != meshplan_ir::Framework::MegatronDeepspeed
        {
            r.push("Megatron-LM has no ALiBi position embedding; Megatron-DeepSpeed has one: re-plan with --framework megatron-deepspeed");
        }
    }
    r.check()?;
    let Some(t) = t else {
        unreachable!("a missing architecture is refused above")
    };

    let mut a = ArgList::new(plan, Target::Megatron);
    let fsdp = c.zero >= 2;
    // validate_args: tensor or context parallelism on GPUs before Blackwell needs
    // CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue keeps the communication
    // kernels in launch order); Megatron-FSDP needs it unset or above 1, and
    // only warns next to tensor or context parallelism.
    let env = if fsdp {
        a.comment(
            "Megatron-FSDP: leave CUDA_DEVICE_MAX_CONNECTIONS unset (validate_args refuses 1)",
        );
        ""
    } else if c.tp > 1 || c.cp > 1 {
        a.comment("tensor or context parallelism: Megatron-LM's validate_args requires CUDA_DEVICE_MAX_CONNECTIONS=1 on GPUs before Blackwell");
        "CUDA_DEVICE_MAX_CONNECTIONS=1 "
    } else {
        ""
    };
    let nodes = plan.cluster.nodes;
    let rendezvous = if nodes > 1 {
        // The same command on every node, each with its own NODE_RANK (0..nodes-1)
        // and node 0's address as MASTER_ADDR.
        " --node-rank $NODE_RANK --master-addr $MASTER_ADDR --master-port ${MASTER_PORT:-6000}"
            .to_string()
    } else {
        String::new()
    };
    a.comment(format!(
        "{env}torchrun --nnodes {nodes}{rendezvous} --nproc-per-node {} pretrain_gpt.py $(grep -v '^#' THIS_FILE) plus data, tokenizer, optimizer and checkpoint arguments",
        plan.cluster.gpus_per_node
    ));
    if nodes > 1 {
        a.comment(format!(
            "on each node: NODE_RANK = 0..{} and MASTER_ADDR = node 0's address, the same on every node",
            nodes - 1
        ));
    }
    // Parallelism.
    a.opt("--tensor-model-parallel-size", c.tp);
    a.opt("--pipeline-model-parallel-size", c.pp);
    if c.vpp > 1 {
        a.opt(
            "--num-layers-per-virtual-pipeline-stage",
            layers / (c.pp * c.vpp),
        );
    }
    if let Some((first, last)) = first_last {
        a.opt("--decoder-first-pipeline-num-layers", first);
        a.opt("--decoder-last-pipeline-num-layers", last);
    }
    if c.sp {
        a.flag("--sequence-parallel");
    }
    if c.tp_overlap {
        a.flag("--tp-comm-overlap");
    }
    if c.cp > 1 {
        a.opt("--context-parallel-size", c.cp);
    }
    if t.moe.is_some() && c.ep > 1 {
        a.opt("--expert-model-parallel-size", c.ep);
        // The plan places whole experts on ranks once they are split by expert.
        a.opt("--expert-tensor-parallel-size", 1);
    }
    // ZeRO-1 is the distributed optimizer; ZeRO-2/3 are Megatron-FSDP's sharding
    // strategies (which run on the distributed optimizer).
    if c.zero >= 1 {
        a.flag("--use-distributed-optimizer");
    }
    if fsdp {
        a.flag("--use-megatron-fsdp");
        a.opt(
            "--data-parallel-sharding-strategy",
            if c.zero == 2 {
                "optim_grads"
            } else {
                "optim_grads_params"
            },
        );
        // Megatron-FSDP saves only this format (validate_args).
        a.opt("--ckpt-format", "fsdp_dtensor");
    }
    // Batch.
    a.opt("--micro-batch-size", c.mbs);
    a.opt("--global-batch-size", global_batch);
    a.opt("--seq-length", seq);
    // Recomputation.
    match c.recompute {
        Recompute::None => {}
        Recompute::Selective => a.opt("--recompute-granularity", "selective"),
        Recompute::Full => {
            a.opt("--recompute-granularity", "full");
            a.opt("--recompute-method", "uniform");
            a.opt("--recompute-num-layers", 1);
        }
    }
    a.opt(
        "--attention-backend",
        match c.attn {
            meshplan_ir::AttnImpl::Flash => "flash",
            meshplan_ir::AttnImpl::Unfused => "unfused",
        },
    );
    match plan.model.dtype {
        DType::Bf16 => a.flag("--bf16"),
        DType::F16 => a.flag("--fp16"),
        _ => {}
    }
    // Model shape.
    a.opt("--num-layers", t.layers);
    a.opt("--hidden-size", t.hidden);
    a.opt("--ffn-hidden-size", t.ffn_hidden);
    a.opt("--num-attention-heads", t.heads);
    if t.mla.is_none() && t.head_dim * t.heads != t.hidden {
        a.opt("--kv-channels", t.head_dim);
    }
    if t.kv_heads < t.heads && t.mla.is_none() {
        a.flag("--group-query-attention");
        a.opt("--num-query-groups", t.kv_heads);
    }
    if let Some(m) = &t.mla {
        a.flag("--multi-latent-attention");
        if let Some(q) = m.q_lora_rank {
            a.opt("--q-lora-rank", q);
        }
        a.opt("--kv-lora-rank", m.kv_lora_rank);
        a.opt("--qk-head-dim", m.qk_nope_head_dim);
        a.opt("--qk-pos-emb-head-dim", m.qk_rope_head_dim);
        a.opt("--v-head-dim", m.v_head_dim);
    }
    match t.position {
        PositionKind::Rope => {
            a.opt("--position-embedding-type", "rope");
            a.opt("--rotary-base", fmt_num(t.rope_theta));
            a.opt("--max-position-embeddings", seq.max(t.max_positions));
        }
        PositionKind::Learned => {
            a.opt("--position-embedding-type", "learned_absolute");
            a.opt("--max-position-embeddings", t.max_positions.max(seq));
        }
        // Only Megatron-DeepSpeed plans reach here with ALiBi (Megatron-Core has no
        // ALiBi; the framework check refuses such a plan): its `PositionEmbeddingType`.
        PositionKind::Alibi => {
            a.opt("--position-embedding-type", "alibi");
            a.opt("--max-position-embeddings", seq);
        }
    }
    if t.mlp == MlpKind::Swiglu {
        a.flag("--swiglu");
    }
    a.opt(
        "--normalization",
        match t.norm {
            NormKind::Layernorm => "LayerNorm",
            NormKind::Rmsnorm => "RMSNorm",
        },
    );
    a.opt("--norm-epsilon", fmt_num(t.norm_eps));
    if !t.bias {
        a.flag("--disable-bias-linear");
        if t.qkv_bias {
            a.flag("--add-qkv-bias");
        }
    }
    if !t.tie_embeddings {
        a.flag("--untie-embeddings-and-output-weights");
    }
    if !t.dropout {
        a.opt("--attention-dropout", 0);
        a.opt("--hidden-dropout", 0);
    }
    a.opt("--vocab-size", t.vocab);
    if let Some(d) = vocab_divisor.filter(|&d| d != 128) {
        a.opt("--make-vocab-size-divisible-by", d);
    }
    if let Some(m) = &t.moe {
        a.opt("--num-experts", m.experts);
        a.opt("--moe-router-topk", m.top_k);
        a.opt("--moe-ffn-hidden-size", m.expert_ffn_hidden);
        if m.shared_experts > 0 {
            a.opt(
                "--moe-shared-expert-intermediate-size",
                m.shared_experts * m.shared_expert_ffn_hidden.unwrap_or(m.expert_ffn_hidden),
            );
        }
        if m.first_dense_layers > 0 {
            a.opt(
                "--moe-layer-freq",
                format!(
                    "([0]*{}+[1]*{})",
                    m.first_dense_layers,
                    t.layers.saturating_sub(m.first_dense_layers)
                ),
            );
        }
    }
    Ok(a.render())
}

/// A float as Megatron's argparse reads it back, without a trailing `.0` noise.
fn fmt_num(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else {
        format!("{x:e}")
    }
}
