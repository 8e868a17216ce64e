//! Criterion benchmark of the CPU kernels whose speed is not the matrix
//! products': LayerNorm and RMSNorm (a training step calls each 13 times) and
//! causal attention (6 times), forward and backward, at small-gpt's shape (8
//! sequences of 256 tokens, hidden 384, 6 heads of 64), on the calling thread
//! (outside a pool a kernel runs on one); and picking a generated token, greedy
//! or sampled, from a real vocabulary.
//!
//! Run: `cargo bench -p meshplan-benches --bench kernels`.

use criterion::{criterion_group, criterion_main, Criterion};
use meshplan_kernels::cpu::attention::{
    attention_bwd, attention_bwd_qkv, attention_fwd, attention_fwd_qkv, AttnDims, Qkv, QkvGrads,
};
use meshplan_kernels::cpu::norm::{layernorm_bwd, layernorm_fwd, rmsnorm_bwd, rmsnorm_fwd};
use std::hint::black_box;

/// The allocator of the `meshplan` binary: the kernels' scratch buffers are
/// reused as they are there, where glibc's would return them to the kernel and
/// fault them in again on every call.
#[global_allocator]
static ALLOC: meshplan_executor::alloc::Allocator = meshplan_executor::alloc::ALLOCATOR;

const ROWS: usize = 8 * 256;
const DIM: usize = 384;

/// Values in [-1, 1) from a fixed linear congruential sequence.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    meshplan_executor::alloc::keep_freed_memory();
    let n = ROWS * DIM;
    let (x, dy, w, b) = (values(n, 1), values(n, 2), values(DIM, 3), values(DIM, 4));
    let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
    let (mut mean, mut rstd) = (vec![0.0; ROWS], vec![0.0; ROWS]);
    let (mut dw, mut db) = (vec![0.0; DIM], vec![0.0; DIM]);
    let mut g = c.benchmark_group("norms 2048x384, 1 thread");
    g.bench_function("layernorm_fwd", |bn| {
        bn.iter(|| {
            layernorm_fwd(
                black_box(&x),
                &w,
                &b,
                ROWS,
                DIM,
                1e-5,
                &mut y,
                &mut mean,
                &mut rstd,
            )
            .expect("the shapes agree")
        })
    });
    g.bench_function("layernorm_bwd", |bn| {
        bn.iter(|| {
            layernorm_bwd(
                black_box(&x),
                &w,
                &mean,
                &rstd,
                &dy,
                ROWS,
                DIM,
                &mut dx,
                &mut dw,
                &mut db,
            )
            .expect("the shapes agree")
        })
    });
    g.bench_function("rmsnorm_fwd", |bn| {
        bn.iter(|| {
            rmsnorm_fwd(black_box(&x), &w, ROWS, DIM, 1e-5, &mut y, &mut rstd)
                .expect("the shapes agree")
        })
    });
    g.bench_function("rmsnorm_bwd", |bn| {
        bn.iter(|| {
            rmsnorm_bwd(black_box(&x), &w, &rstd, &dy, ROWS, DIM, &mut dx, &mut dw)
                .expect("the shapes agree")
        })
    });
    g.finish();

    let dims = AttnDims {
        batch: 8,
        sq: 256,
        sk: 256,
        hq: 6,
        hkv: 6,
        d: 64,
        dv: 64,
    };
    let (q, k, v) = (values(n, 5), values(n, 6), values(n, 7));
    let mut lse = vec![0.0; 8 * 6 * 256];
    let scale = 1.0 / 8.0;
    let (mut dq, mut dk, mut dv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let mut g = c.benchmark_group("causal attention 8x256, 6 heads of 64, 1 thread");
    g.bench_function("attention_fwd", |bn| {
        bn.iter(|| {
            attention_fwd(
                &dims,
                black_box(&q),
                &k,
                &v,
                0,
                0,
                true,
                scale,
                &mut y,
                &mut lse,
                None,
            )
            .expect("the shapes agree")
        })
    });
    g.bench_function("attention_bwd", |bn| {
        bn.iter(|| {
            attention_bwd(
                &dims,
                black_box(&q),
                &k,
                &v,
                &y,
                &lse,
                &dy,
                0,
                0,
                true,
                scale,
                &mut dq,
                &mut dk,
                &mut dv,
                None,
            )
            .expect("the shapes agree")
        })
    });
    // GPT-2's attention reads its operands in place from the fused `q | k | v`
    // projection's rows and adds its gradients into fused rows.
    let x3 = values(3 * n, 8);
    let mut dx3 = vec![0.0; 3 * n];
    g.bench_function("attention_fwd_fused", |bn| {
        bn.iter(|| {
            let qkv = Qkv::Fused(black_box(&x3));
            attention_fwd_qkv(&dims, qkv, (0, 0), true, scale, &mut y, &mut lse, None)
                .expect("the shapes agree")
        })
    });
    g.bench_function("attention_bwd_fused", |bn| {
        bn.iter(|| {
            let (qkv, grads) = (Qkv::Fused(black_box(&x3)), QkvGrads::Fused(&mut dx3));
            let ins = (&y[..], &lse[..], &dy[..]);
            attention_bwd_qkv(&dims, qkv, ins, (0, 0), true, scale, grads, None)
                .expect("the shapes agree")
        })
    });
    g.finish();
    bench_pick(c);
}

/// Picking the next token of 4 requests from Llama 3's vocabulary (128,256), the
/// logits uniform in [-5, 5): greedily, and drawn at temperature 0.8 within a
/// nucleus of 0.9.
fn bench_pick(c: &mut Criterion) {
    use meshplan_kernels::cpu::{argmax_parts, sample_parts, Nucleus, Picks};
    let (rows, vocab) = (4, 128_256);
    let x: Vec<f32> = values(rows * vocab, 5).iter().map(|v| 5.0 * v).collect();
    let d = Picks {
        parts: 1,
        rows,
        cols: vocab,
        limit: vocab,
    };
    let mut g = c.benchmark_group("next token of 4 rows of 128256 logits, 1 thread");
    g.bench_function("argmax_parts", |bn| {
        bn.iter(|| argmax_parts(black_box(&x), d).expect("the shapes agree"))
    });
    let mut step = 0;
    g.bench_function("sample_parts", |bn| {
        bn.iter(|| {
            step += 1;
            let s = Nucleus {
                temperature: 0.8,
                top_p: 0.9,
                seed: 1,
                step,
            };
            sample_parts(black_box(&x), d, s, &[0, 1, 2, 3]).expect("the shapes agree")
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
