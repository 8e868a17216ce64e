//! The software a plan is for. A framework is a set of mechanisms; this module holds
//! what each can *run* (parallel modes, schedules, batch and layer arithmetic), the
//! part the planner's search and every exporter must agree on. How fast each runs
//! (attention kernels, overlap, gather granularity) belongs to the cost model.

use crate::config::{AttnImpl, ParallelConfig, Recompute, Schedule};
use crate::graph::{ExpertWeight, Graph, OpKind};
use std::fmt;
use std::str::FromStr;

/// A training framework the planner can target.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum Framework {
    /// meshplan's own executor: every mode it plans.
    #[default]
    Meshplan,
    /// Megatron-LM / Megatron-Core (`pretrain_gpt.py`).
    MegatronCore,
    /// torchtitan: FSDP2 (or DDP) + TP (always with sequence parallelism) + PP + CP.
    Torchtitan,
    /// DeepSpeed alone: ZeRO 0-3 over data-parallel ranks, nothing else.
    Deepspeed,
    /// Megatron-DeepSpeed: Megatron's tensor parallelism, DeepSpeed's pipeline
    /// engine (1F1B without virtual stages) and ZeRO (at most stage 1 with a pipeline).
    MegatronDeepspeed,
}

impl Framework {
    /// Every framework, in the order `--help` lists them.
    pub const ALL: [Framework; 5] = [
        Framework::Meshplan,
        Framework::MegatronCore,
        Framework::Torchtitan,
        Framework::Deepspeed,
        Framework::MegatronDeepspeed,
    ];

    /// The spelling on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            Framework::Meshplan => "meshplan",
            Framework::MegatronCore => "megatron-core",
            Framework::Torchtitan => "torchtitan",
            Framework::Deepspeed => "deepspeed",
            Framework::MegatronDeepspeed => "megatron-deepspeed",
        }
    }

    /// The `export --to` target that writes this framework's launch files.
    pub fn export_target(self) -> Option<&'static str> {
        match self {
            Framework::Meshplan => None,
            Framework::MegatronCore | Framework::MegatronDeepspeed => Some("megatron"),
            Framework::Torchtitan => Some("torchtitan"),
            Framework::Deepspeed => Some("deepspeed"),
        }
    }

    /// Why this framework has no flash (fused, tiled) attention kernel for the
    /// model's attention; `None` when it has one. Every flash kernel a framework
    /// runs (FlashAttention 2 and 3, cuDNN's fused attention through Transformer
    /// Engine, meshplan's own) holds a head of at most 256 values in registers.
    /// ALiBi's biases are free inside FlashAttention since 2.4 (`alibi_slopes`), but
    /// the frameworks that run ALiBi models compute them on a materialised score
    /// matrix.
    pub fn flash_gap(self, needs: &Needs) -> Option<String> {
        let name = self.name();
        if needs.head_dim > 256 {
            return Some(format!(
                "{name}'s flash attention kernels take heads of at most 256 values, this model's are {}: attn=unfused",
                needs.head_dim
            ));
        }
        if !needs.alibi {
            return None;
        }
        match self {
            Framework::Meshplan | Framework::MegatronCore | Framework::Torchtitan => None,
            Framework::MegatronDeepspeed => Some(format!(
                "{name} adds ALiBi's biases in its fused softmax over the materialised scores (its flash path takes no slopes): attn=unfused"
            )),
            Framework::Deepspeed => Some(format!(
                "{name} runs the Hugging Face model, whose ALiBi attention (BLOOM, MPT) materialises the scores: attn=unfused"
            )),
        }
    }

    /// The attention kernel the framework runs when a configuration does not name
    /// one: flash where it has a flash kernel for the model.
    pub fn default_attn(self, needs: &Needs) -> AttnImpl {
        match self.flash_gap(needs) {
            None => AttnImpl::Flash,
            Some(_) => AttnImpl::Unfused,
        }
    }

    /// Why this framework cannot run `cfg` on the model and batch `needs` describes;
    /// empty when it can. Layer splits are judged by [`Framework::split_ok`].
    pub fn cannot_run(self, cfg: &ParallelConfig, needs: &Needs) -> Vec<String> {
        let Needs {
            layers,
            vocab,
            global_batch,
            ..
        } = *needs;
        let mut why = Vec::new();
        let name = self.name();
        if needs.alibi {
            match self {
                Framework::MegatronCore => why.push(format!(
                    "{name} has no ALiBi position embedding (--position-embedding-type takes learned_absolute, rope or none); megatron-deepspeed has one"
                )),
                Framework::Torchtitan => why.push(format!(
                    "{name}'s models place tokens with RoPE; ALiBi needs a model of your own (megatron-deepspeed and deepspeed run BLOOM)"
                )),
                _ => {}
            }
        }
        if cfg.attn == AttnImpl::Flash {
            why.extend(self.flash_gap(needs));
        }
        // Every framework runs exactly the batch asked for, meshplan's executor
        // too (it refuses a padded plan). meshplan's search prefers exact batches
        // and pads only where the fixed keys leave nothing else (`pads`): such a
        // plan is estimated and compared, with a warning, and not run.
        let per_step = cfg.dp.saturating_mul(cfg.mbs).max(1);
        if self != Framework::Meshplan && pads(cfg, global_batch) {
            why.push(format!(
                "the global batch ({global_batch}) is not a whole number of micro-batches on every replica: dp({}) x mbs({}) = {per_step} does not divide it",
                cfg.dp, cfg.mbs
            ));
        }
        let deg = [
            ("tp", cfg.tp),
            ("pp", cfg.pp),
            ("cp", cfg.cp),
            ("ep", cfg.ep),
        ];
        match self {
            Framework::Meshplan => {
                // The executor holds each tensor rank's whole share of every split
                // width; a remainder has no rank (`shard::check_split`).
                if cfg.tp > 1 && needs.vocab > 1 && !needs.vocab.is_multiple_of(cfg.tp) {
                    why.push(format!(
                        "{name}'s executor splits the vocabulary ({vocab}) over tp whole: tp={} does not divide it; pad it as Megatron-LM does (plan with --make-vocab-size-divisible-by 128, or set the model's `transformer.make_vocab_size_divisible_by`: 128 pads 50257 tokens to 50304 rows) or use a tp that divides it",
                        cfg.tp
                    ));
                }
                // A rank whose slice is all padding has no softmax to take.
                if cfg.tp > 1 && needs.vocab_padding > 0 && vocab / cfg.tp <= needs.vocab_padding {
                    why.push(format!(
                        "{name}'s executor needs a token in every tensor rank's slice of the vocabulary: {vocab} rows over tp={} leave the last {} rows of padding only; use a smaller make_vocab_size_divisible_by",
                        cfg.tp, needs.vocab_padding
                    ));
                }
                if cfg.tp > 1 && needs.tp_widths > 0 && !needs.tp_widths.is_multiple_of(cfg.tp) {
                    why.push(format!(
                        "{name}'s executor splits the layers' widths over tp whole: tp={} does not divide every one (their greatest common divisor is {})",
                        cfg.tp, needs.tp_widths
                    ));
                }
            }
            Framework::Deepspeed => {
                for (k, d) in deg {
                    if d > 1 {
                        why.push(format!("{name} splits a model only over data-parallel ranks (ZeRO): {k}={d} needs megatron-deepspeed"));
                    }
                }
                if cfg.recompute == Recompute::Selective {
                    why.push(format!(
                        "{name} checkpoints whole layers: recompute=selective has no switch"
                    ));
                }
                if cfg.tp_overlap {
                    why.push(format!("{name} has no tensor axis to overlap (tp_overlap)"));
                }
            }
            Framework::MegatronCore => {
                // What `export --to megatron` refuses too.
                if needs.mla && cfg.cp > 1 {
                    why.push(format!(
                        "{name} runs multi-latent attention without context parallelism (cp={})",
                        cfg.cp
                    ));
                }
                if cfg.pp > 1 && cfg.schedule == Schedule::Gpipe {
                    why.push(format!(
                        "{name} has no GPipe schedule (1F1B or interleaved 1F1B)"
                    ));
                }
                if cfg.vpp > 1 && !layers.is_multiple_of(cfg.pp * cfg.vpp) {
                    why.push(format!(
                        "{name} needs the {layers} layers to divide into pp({}) x vpp({}) chunks",
                        cfg.pp, cfg.vpp
                    ));
                }
                if !vocab.is_multiple_of(cfg.tp) {
                    why.push(format!(
                        "{name} pads the vocabulary ({vocab}) to a multiple of tp({}); plan the padded model with --make-vocab-size-divisible-by 128",
                        cfg.tp
                    ));
                }
            }
            Framework::Torchtitan => {
                if cfg.zero == 1 {
                    why.push(format!(
                        "{name} has no ZeRO-1 (its data axis is DDP or FSDP: zero=0, 2 or 3)"
                    ));
                }
                if cfg.tp > 1 && !cfg.sp {
                    why.push(format!(
                        "{name}'s tensor parallelism always shards the sequence (sp=true)"
                    ));
                }
                if cfg.pp > 1 && !layers.is_multiple_of(cfg.pp * cfg.vpp) {
                    why.push(format!("{name} gives every pipeline stage the same layer count: {layers} layers do not divide into pp({}) x vpp({})", cfg.pp, cfg.vpp));
                }
            }
            Framework::MegatronDeepspeed => {
                if !layers.is_multiple_of(cfg.pp) {
                    why.push(format!("{name}'s pipeline engine is planned here with the same layer count per stage: {layers} layers do not divide into pp({})", cfg.pp));
                }
                if cfg.vpp > 1 || cfg.schedule != Schedule::OneFOneB {
                    why.push(format!(
                        "{name}'s pipeline engine runs 1F1B without virtual stages"
                    ));
                }
                if cfg.pp > 1 && cfg.zero > 1 {
                    why.push(format!(
                        "{name} combines a pipeline with ZeRO stage 1 at most (zero={})",
                        cfg.zero
                    ));
                }
                if cfg.cp > 1 || cfg.ep > 1 {
                    why.push(format!("{name} is planned here without context or expert parallelism (cp={}, ep={})", cfg.cp, cfg.ep));
                }
                if !vocab.is_multiple_of(cfg.tp) {
                    why.push(format!(
                        "{name} pads the vocabulary ({vocab}) to a multiple of tp({}); plan the padded model with --make-vocab-size-divisible-by 128",
                        cfg.tp
                    ));
                }
            }
        }
        why
    }

    /// Whether the framework can split layers over `pp` stages of `vpp` chunks as
    /// `split` (block layers per chunk, in order) says.
    pub fn split_ok(self, split: &[u64], pp: u64, vpp: u64) -> bool {
        let even = split.windows(2).all(|w| w[0] == w[1]);
        match self {
            Framework::Meshplan => true,
            Framework::Torchtitan | Framework::MegatronDeepspeed => even,
            // --decoder-first/last-pipeline-num-layers: only the ends may differ,
            // and not with virtual stages.
            Framework::MegatronCore => {
                even || (vpp == 1
                    && split.len() == pp as usize
                    && split.len() >= 2
                    && split[1..split.len() - 1].windows(2).all(|w| w[0] == w[1]))
            }
            Framework::Deepspeed => split.len() <= 1,
        }
    }
}

impl Framework {
    /// The split of `layers` over `pp` stages this framework takes when stages
    /// cannot be even: Megatron-Core's `--decoder-first/last-pipeline-num-layers`
    /// give the middle stages `m` layers each and the two ends the rest, `m` the
    /// ceiling or floor of `layers / pp` (whichever makes the fullest stage smaller),
    /// the first end at least as full as the last (which also holds the head and
    /// the loss). `None` for a framework without uneven stages, with virtual stages,
    /// or when the ends would be empty.
    pub fn ends_split(self, layers: u64, pp: u64, vpp: u64) -> Option<Vec<u64>> {
        if self != Framework::MegatronCore || vpp != 1 || pp < 3 {
            return None;
        }
        let middle = pp - 2;
        let floor = layers / pp;
        [floor + 1, floor]
            .into_iter()
            .filter(|&m| m >= 1)
            .filter_map(|m| {
                let rest = layers.checked_sub(middle * m)?;
                (rest >= 2).then(|| {
                    let last = rest / 2;
                    let mut split = vec![rest - last];
                    split.extend(std::iter::repeat_n(m, middle as usize));
                    split.push(last);
                    split
                })
            })
            .min_by_key(|s| s.iter().copied().max().unwrap_or(0))
    }
}

/// What a framework must run besides the layout: the model's shape, its attention
/// and the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    /// Transformer blocks.
    pub layers: u64,
    /// Vocabulary rows (1 where the graph has none), padding included.
    pub vocab: u64,
    /// Of those, the padded rows (`make_vocab_size_divisible_by`), no token.
    pub vocab_padding: u64,
    /// Sequences per optimizer step.
    pub global_batch: u64,
    /// Attention with ALiBi biases.
    pub alibi: bool,
    /// Query/key width of one head.
    pub head_dim: u64,
    /// Latent attention (DeepSeek's MLA).
    pub mla: bool,
    /// The greatest common divisor of the layers' widths that tensor parallelism
    /// splits by rows (the MLP's hidden width, the attention output's input, an
    /// expert's hidden width); 0 where the graph has none.
    pub tp_widths: u64,
}

impl Needs {
    /// The needs of `graph`, split into `layers` blocks, at `global_batch`.
    pub fn of(graph: &Graph, layers: u64, global_batch: u64) -> Needs {
        let attention = graph.ops().find_map(|o| match o.kind {
            OpKind::Attention(a) => Some(a),
            _ => None,
        });
        Needs {
            layers,
            vocab: graph.vocab_rows().or(graph.vocab()).unwrap_or(1),
            vocab_padding: graph
                .vocab_rows()
                .zip(graph.vocab())
                .map_or(0, |(rows, tokens)| rows.saturating_sub(tokens)),
            global_batch,
            alibi: attention.is_some_and(|a| a.alibi),
            mla: graph.ops().any(crate::graph::latent_attention),
            head_dim: attention.map_or(0, |a| a.qk_dim),
            tp_widths: tp_widths(graph),
        }
    }
}

/// [`Needs::tp_widths`] of `graph`: the rows of row-parallel weights, and of each
/// expert's MLP its hidden width (its weights' part, [`ExpertWeight`], says where).
fn tp_widths(graph: &Graph) -> u64 {
    let fixed = |t: crate::graph::TensorId| -> Vec<u64> {
        (graph.tensor(t).shape.iter())
            .filter_map(|d| match d {
                crate::graph::Dim::Fixed(n) => Some(*n),
                _ => None,
            })
            .collect()
    };
    let mut g = 0;
    for op in graph.ops() {
        if op.role == crate::graph::TpRole::Experts {
            for &w in &op.inputs {
                if let (Some(part), [_, r, c]) = (ExpertWeight::of(op, w), fixed(w).as_slice()) {
                    g = crate::config::gcd(g, part.hidden_width(*r, *c));
                }
            }
            continue;
        }
        let Some(&w) = op.inputs.get(1) else {
            continue;
        };
        if let (crate::graph::TpRole::RowParallel, [rows, _]) = (op.role, fixed(w).as_slice()) {
            g = crate::config::gcd(g, *rows);
        }
    }
    g
}

/// Whether `cfg` computes more sequences than `global_batch` (dp x mbs does not
/// divide it, so the micro-batch count is rounded up).
pub fn pads(cfg: &ParallelConfig, global_batch: u64) -> bool {
    !global_batch.is_multiple_of(cfg.dp.saturating_mul(cfg.mbs).max(1))
}

impl fmt::Display for Framework {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Framework {
    type Err = String;
    fn from_str(s: &str) -> Result<Framework, String> {
        let key = s.trim().to_ascii_lowercase().replace('_', "-");
        let alias = match key.as_str() {
            "megatron" | "megatron-lm" => "megatron-core",
            "fsdp" | "fsdp2" => "torchtitan",
            k => k,
        };
        Framework::ALL
            .into_iter()
            .find(|f| f.name() == alias)
            .ok_or_else(|| {
                let names: Vec<&str> = Framework::ALL.iter().map(|f| f.name()).collect();
                format!(
                    "unknown framework `{s}`; expected one of {}",
                    names.join(", ")
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_core_ends_split_by_hand() {
        // GPT-3's 96 layers over 15 stages: 13 middle stages of 7, ends 3 and 2 (the
        // floor, 6, would leave 18 for the ends: 9 and 9, a fuller stage).
        let s = Framework::MegatronCore
            .ends_split(96, 15, 1)
            .expect("a split");
        assert_eq!(s[0], 3);
        assert_eq!(s[14], 2);
        assert!(s[1..14].iter().all(|&m| m == 7));
        assert_eq!(s.iter().sum::<u64>(), 96);
        assert!(Framework::MegatronCore.split_ok(&s, 15, 1));
        // 80 layers over 6 stages: middle 14 each (4 x 14 = 56), ends 12 and 12.
        assert_eq!(
            Framework::MegatronCore.ends_split(80, 6, 1),
            Some(vec![12, 14, 14, 14, 14, 12])
        );
        assert_eq!(Framework::MegatronCore.ends_split(96, 15, 2), None);
        assert_eq!(Framework::Torchtitan.ends_split(96, 15, 1), None);
    }

    fn cfg(dp: u64, tp: u64, pp: u64, mbs: u64) -> ParallelConfig {
        crate::PartialConfig::parse(&format!("dp={dp},tp={tp},pp={pp},mbs={mbs}"), "test")
            .and_then(|p| p.resolve(dp * tp * pp, "test"))
            .expect("a configuration")
    }

    fn needs(layers: u64, vocab: u64, global_batch: u64) -> Needs {
        Needs {
            layers,
            vocab,
            vocab_padding: 0,
            global_batch,
            alibi: false,
            mla: false,
            head_dim: 128,
            tp_widths: 4096,
        }
    }

    #[test]
    fn flash_kernels_by_head_width_and_alibi() {
        let mut n = needs(70, 250880, 2048);
        for f in Framework::ALL {
            assert_eq!(f.default_attn(&n), AttnImpl::Flash, "{f}");
        }
        // BLOOM: ALiBi, heads of 128.
        n.alibi = true;
        let runs = |f: Framework, attn, n: &Needs| {
            let mut c = cfg(8, 1, 1, 1);
            c.attn = attn;
            f.cannot_run(&c, n)
        };
        assert_eq!(Framework::Meshplan.default_attn(&n), AttnImpl::Flash);
        for f in [Framework::MegatronDeepspeed, Framework::Deepspeed] {
            assert_eq!(f.default_attn(&n), AttnImpl::Unfused, "{f}");
            assert!(runs(f, AttnImpl::Unfused, &n).is_empty(), "{f}");
            let why = runs(f, AttnImpl::Flash, &n);
            assert!(why.len() == 1 && why[0].contains("ALiBi"), "{why:?}");
        }
        for f in [Framework::MegatronCore, Framework::Torchtitan] {
            let why = runs(f, AttnImpl::Unfused, &n);
            assert!(why.iter().any(|w| w.contains("ALiBi")), "{f}: {why:?}");
        }
        // Heads wider than 256: no framework has a flash kernel.
        n.alibi = false;
        n.head_dim = 320;
        for f in Framework::ALL {
            assert_eq!(f.default_attn(&n), AttnImpl::Unfused, "{f}");
            assert!(
                runs(f, AttnImpl::Flash, &n)[0].contains("at most 256"),
                "{f}"
            );
        }
    }

    #[test]
    fn no_framework_pads_the_batch() {
        assert!(pads(&cfg(480, 8, 1, 4), 1536) && !pads(&cfg(16, 1, 1, 4), 1536));
        // GPT-3 on 3840 GPUs: dp=480, mbs=4 would compute 1920 sequences for 1536.
        for f in Framework::ALL
            .into_iter()
            .filter(|f| *f != Framework::Meshplan)
        {
            let why = f.cannot_run(&cfg(480, 8, 1, 4), &needs(96, 51200, 1536));
            assert!(
                why.iter().any(|w| w.contains("= 1920 does not divide")),
                "{f}: {why:?}"
            );
            assert!(f
                .cannot_run(&cfg(16, 1, 1, 4), &needs(96, 51200, 1536))
                .iter()
                .all(|w| !w.contains("batch")));
        }
    }

    #[test]
    fn a_padded_vocabulary_widens_the_table_and_logits_and_lets_tp_split_them() {
        let gpt2 = |pad: &str| {
            let text = std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../models/gpt2-124m.yaml"
            ))
            .expect("the GPT-2 model file")
            .replace("  vocab: 50257\n", &format!("  vocab: 50257\n{pad}"));
            let spec = crate::parse_model_yaml(&text, "gpt2.yaml").expect("a model");
            crate::model_graph(&spec).expect("a graph")
        };
        let rows = |g: &Graph, name: &str| {
            let t = g.tensors.iter().find(|t| t.name == name).expect(name);
            t.shape.clone()
        };
        let plain = gpt2("");
        let padded = gpt2("  make_vocab_size_divisible_by: 128\n");
        // 50257 rounded up to a multiple of 128 = 393 x 128.
        use crate::graph::Dim;
        assert_eq!(padded.vocab_rows(), Some(50304));
        assert_eq!(padded.vocab(), Some(50257));
        assert_eq!(
            (plain.vocab_rows(), plain.vocab()),
            (Some(50257), Some(50257))
        );
        assert_eq!(
            rows(&padded, "embed.tokens.w"),
            [Dim::Fixed(50304), Dim::Fixed(768)]
        );
        assert_eq!(
            rows(&padded, "head.lm.out").last(),
            Some(&Dim::Fixed(50304))
        );
        let m = Framework::Meshplan;
        for tp in [2, 4, 8] {
            let why = m.cannot_run(&cfg(1, tp, 1, 1), &Needs::of(&plain, 12, 512));
            assert!(
                why.iter()
                    .any(|w| w.contains("make_vocab_size_divisible_by")),
                "{why:?}"
            );
            let why = m.cannot_run(&cfg(1, tp, 1, 1), &Needs::of(&padded, 12, 512));
            assert!(why.is_empty(), "tp={tp}: {why:?}");
        }
        // 64 rows over tp=4, 16 a rank: 48 tokens leave the last rank padding only,
        // 49 give it one token.
        let padded_to_64 = |tokens: u64| Needs {
            vocab_padding: 64 - tokens,
            ..needs(2, 64, 8)
        };
        let why = m.cannot_run(&cfg(1, 4, 1, 1), &padded_to_64(48));
        assert!(why.len() == 1 && why[0].contains("padding only"), "{why:?}");
        assert!(m.cannot_run(&cfg(1, 4, 1, 1), &padded_to_64(49)).is_empty());
        assert_eq!(Needs::of(&padded, 12, 512).vocab_padding, 47);
        let bad = |vocab: u64, by: u64| {
            let text = format!(
                "name: m\ntransformer: {{layers: 1, hidden: 8, heads: 2, vocab: {vocab}, make_vocab_size_divisible_by: {by}}}\n"
            );
            let e = crate::parse_model_yaml(&text, "m.yaml").map(|_| ());
            e.unwrap_err().to_string()
        };
        let zero = bad(10, 0);
        assert!(
            zero.contains("transformer.make_vocab_size_divisible_by"),
            "{zero}"
        );
        // 2^24 - 1 tokens rounded up to a multiple of 11 pass 2^24 rows.
        let past = bad(crate::spec::DIM_MAX - 1, 11);
        assert!(past.contains("past the supported maximum"), "{past}");
    }

    #[test]
    fn meshplan_splits_the_vocabulary_and_widths_over_tp_whole() {
        let m = Framework::Meshplan;
        // GPT-2's 50257 tokens: no tp > 1; GPT-3's 51200: tp=8.
        let why = m.cannot_run(&cfg(4, 2, 1, 1), &needs(12, 50257, 64));
        assert!(
            why.len() == 1 && why[0].contains("vocabulary (50257)") && why[0].contains("tp=2"),
            "{why:?}"
        );
        assert!(m
            .cannot_run(&cfg(1, 8, 1, 1), &needs(96, 51200, 64))
            .is_empty());
        assert!(m
            .cannot_run(&cfg(8, 1, 1, 1), &needs(12, 50257, 64))
            .is_empty());
        // An MLP 129 wide (gcd of the widths 129): no tp=2.
        let odd = Needs {
            tp_widths: 129,
            ..needs(12, 256, 64)
        };
        let why = m.cannot_run(&cfg(4, 2, 1, 1), &odd);
        assert!(
            why.len() == 1 && why[0].contains("divisor is 129"),
            "{why:?}"
        );
        // Not a rule of the other frameworks (Megatron-Core has its own, padding).
        let why = Framework::MegatronCore.cannot_run(&cfg(4, 2, 1, 1), &needs(12, 50257, 64));
        assert!(why.iter().all(|w| !w.contains("executor")), "{why:?}");
        // The widths of a graph: the MLP's hidden width and the attention output.
        let graph = shipped("tiny-gpt", |t| t);
        assert_eq!(tp_widths(&graph), 64, "gcd(ffn 128, heads x head_dim 64)");
        // Routed experts 48 wide: gcd(48, the attention output's 64) = 16, whatever
        // the activation (SwiGLU's up projection [4, 64, 96] holds two halves of 48,
        // GELU's [4, 64, 48] one).
        for mlp in ["swiglu", "gelu"] {
            let graph = shipped("tiny-moe", |t| {
                t.replace("expert_ffn_hidden: 128", "expert_ffn_hidden: 48")
                    .replace("mlp: swiglu", &format!("mlp: {mlp}"))
            });
            assert_eq!(tp_widths(&graph), 16, "{mlp}: gcd(experts 48, 64)");
        }
    }

    /// The graph of `models/NAME.yaml` as `edit` changes its text.
    fn shipped(name: &str, edit: impl Fn(String) -> String) -> Graph {
        let path = format!("{}/../models/{name}.yaml", env!("CARGO_MANIFEST_DIR"));
        let text = edit(std::fs::read_to_string(&path).expect("model"));
        let spec = crate::load::parse_model_yaml(&text, &path).expect("spec");
        crate::model_graph(&spec).expect("graph")
    }

    #[test]
    fn megatron_core_runs_latent_attention_without_context_parallelism() {
        let mla = Needs {
            mla: true,
            ..needs(61, 129280, 1024)
        };
        let m = Framework::MegatronCore;
        let cp2 = crate::PartialConfig::parse("dp=4,cp=2", "test")
            .and_then(|p| p.resolve(8, "test"))
            .expect("a configuration");
        let why = m.cannot_run(&cp2, &mla);
        assert!(
            why.len() == 1 && why[0].contains("multi-latent attention") && why[0].contains("cp=2"),
            "{why:?}"
        );
        assert!(m.cannot_run(&cfg(8, 1, 1, 1), &mla).is_empty());
        assert!(m.cannot_run(&cp2, &needs(61, 129280, 1024)).is_empty());
        assert!(Needs::of(&shipped("deepseek-v3", |t| t), 61, 1024).mla);
    }

    #[test]
    fn deepspeed_runs_data_parallel_plans_only() {
        let d = Framework::Deepspeed;
        assert!(d
            .cannot_run(&cfg(8, 1, 1, 1), &needs(32, 50304, 64))
            .is_empty());
        let why = d.cannot_run(&cfg(2, 2, 2, 1), &needs(32, 50304, 64));
        assert_eq!(why.len(), 2, "{why:?}");
        assert!(
            why[0].contains("tp=2") && why[1].contains("pp=2"),
            "{why:?}"
        );
    }

    #[test]
    fn splits_each_framework_takes() {
        let m = Framework::MegatronCore;
        assert!(m.split_ok(&[5, 6, 6, 5], 4, 1));
        assert!(m.split_ok(&[2, 5, 5, 4], 4, 1));
        assert!(!m.split_ok(&[5, 6, 7, 4], 4, 1));
        assert!(!m.split_ok(&[3, 4, 4, 3, 3, 4, 4, 3], 4, 2));
        assert!(!Framework::Torchtitan.split_ok(&[5, 6, 6, 5], 4, 1));
        assert!(Framework::Torchtitan.split_ok(&[6, 6], 2, 1));
        assert!(Framework::Meshplan.split_ok(&[5, 7], 2, 1));
    }

    #[test]
    fn names_round_trip_and_unknown_ones_list_the_choices() {
        for f in Framework::ALL {
            assert_eq!(f.name().parse::<Framework>(), Ok(f));
        }
        assert_eq!(
            "Megatron-LM".parse::<Framework>(),
            Ok(Framework::MegatronCore)
        );
        let e = "colossal".parse::<Framework>().unwrap_err();
        assert!(
            e.contains("unknown framework `colossal`") && e.contains("megatron-deepspeed"),
            "{e}"
        );
    }
}
