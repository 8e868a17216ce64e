//! Tests of the GPU layer, in two tiers that skip (with the reason printed) where
//! the machine cannot run them:
//!
//! - NVRTC compiles every module for sm_80 and sm_90 with no warning, each kernel
//!   the wrappers load is in the PTX, and the PTX cache round-trips. Needs only
//!   libnvrtc; `REQUIRE_NVRTC=1` turns a skip into a failure. With `$PTXAS` (the
//!   assembler, e.g. from PyPI's nvidia-cuda-nvcc wheel), every module's PTX must
//!   also assemble (inline `asm` included) and the tensor-core attention kernels
//!   must not spill; `REQUIRE_PTXAS=1` turns that skip into a failure.
//! - Every kernel on random inputs against its CPU reference in [`crate::cpu`]
//!   (or, for the layout kernels, a host loop; bf16 tolerances where the GPU
//!   computes in bf16), and the cuBLASLt GEMM
//!   against `cpu::matmul`. Needs a GPU; `REQUIRE_GPU=1` turns a skip into a
//!   failure.

use super::*;
use crate::cpu;
use crate::cpu::testutil::Rng;
use crate::cpu::{AttnDims, AttnDropout, DropoutDraw, RowDropout, Transpose};
use cudarc::driver::CudaSlice;
use half::bf16;

fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

/// Whether NVRTC can be loaded; prints why not, and fails under `REQUIRE_NVRTC=1`.
fn nvrtc_or_skip(test: &str) -> bool {
    match nvrtc_version() {
        Ok(_) => true,
        Err(e) => {
            assert!(
                !required("REQUIRE_NVRTC"),
                "{test}: REQUIRE_NVRTC=1 but NVRTC cannot be used: {e}"
            );
            println!("{test}: skipped, NVRTC cannot be used: {e}");
            false
        }
    }
}

/// The GPU, or `None` after printing why not (a failure under `REQUIRE_GPU=1`).
fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match Gpu::new() {
        Ok(gpu) => Some(gpu),
        Err(e) => {
            assert!(
                !required("REQUIRE_GPU"),
                "{test}: REQUIRE_GPU=1 but no GPU can be used: {e}"
            );
            println!("{test}: skipped, no GPU: {e}");
            None
        }
    }
}

const TEST_ARCHS: [&str; 2] = ["sm_80", "sm_90"];

/// ptxas from `$PTXAS`, or `None` after printing why not (a failure under
/// `REQUIRE_PTXAS=1`). NVRTC writes inline `asm` into the PTX unchecked: only the
/// assembler (or a driver loading the module on a GPU) finds an error in it.
fn ptxas_or_skip(test: &str) -> Option<std::path::PathBuf> {
    let found = std::env::var_os("PTXAS")
        .map(std::path::PathBuf::from)
        .filter(|p| p.is_file());
    if found.is_none() {
        assert!(
            !required("REQUIRE_PTXAS"),
            "{test}: REQUIRE_PTXAS=1 but $PTXAS names no file"
        );
        println!("{test}: skipped, no ptxas (set PTXAS to the assembler's path)");
    }
    found
}

#[test]
fn ptxas_assembles_every_module_without_spills_in_the_attention_kernels() {
    let test = "ptxas_assembles_every_module";
    if !nvrtc_or_skip(test) {
        return;
    }
    let Some(ptxas) = ptxas_or_skip(test) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("meshplan-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for arch in TEST_ARCHS {
        for m in ALL_MODULES {
            let c = compile(m, arch).unwrap_or_else(|e| panic!("{e}"));
            let file = dir.join(format!("{}-{arch}.ptx", m.file()));
            std::fs::write(&file, &c.ptx).unwrap();
            let out = std::process::Command::new(&ptxas)
                .args([&format!("-arch={arch}"), "-v", "-o", "/dev/null"])
                .arg(&file)
                .output()
                .unwrap();
            let log = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "ptxas rejects {} for {arch}:\n{log}",
                m.file()
            );
            // The tensor-core attention kernels are sized to their registers: a
            // spill there is a performance bug (measured on an H200: none spill).
            if m == KernelModule::Attention {
                for entry in log.split("Compiling entry function").skip(1) {
                    let name = entry.split('\'').nth(1).unwrap_or("?");
                    if name.starts_with("flash_") {
                        let regs = entry
                            .lines()
                            .find(|l| l.contains("Used"))
                            .unwrap_or("")
                            .trim();
                        println!("{arch} {name}: {regs}");
                        assert!(
                            entry.contains(" 0 bytes spill stores"),
                            "{name} for {arch} spills registers:\n{entry}"
                        );
                    }
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn nvrtc_compiles_every_module_without_warnings() {
    if !nvrtc_or_skip("nvrtc_compiles_every_module_without_warnings") {
        return;
    }
    let mut kernels = 0;
    for arch in TEST_ARCHS {
        for m in ALL_MODULES {
            let c = compile(m, arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                !c.log.to_lowercase().contains("warning"),
                "{} for {arch} compiled with warnings:\n{}",
                m.file(),
                c.log
            );
            assert!(cache::looks_like_ptx(&c.ptx), "{}: not PTX", m.file());
            assert!(c.ptx.contains(&format!(".target {arch}")), "{}", m.file());
            for k in m.kernels() {
                assert!(
                    c.ptx.contains(&format!(".entry {k}(")),
                    "{} for {arch}: no kernel `{k}` in the PTX",
                    m.file()
                );
                kernels += 1;
            }
        }
    }
    println!(
        "compiled {} modules, {kernels} kernels, for {TEST_ARCHS:?} with NVRTC {:?}",
        ALL_MODULES.len() * TEST_ARCHS.len(),
        nvrtc_version().ok()
    );
}

#[test]
fn nvrtc_reports_errors_with_the_log_and_rejects_bad_arch_names() {
    if !nvrtc_or_skip("nvrtc_reports_errors_with_the_log") {
        return;
    }
    let e = compile(KernelModule::Cast, "sm_90; rm").unwrap_err();
    assert!(e.error.contains("not an architecture"), "{e}");
    // An architecture NVRTC does not know: its log says why.
    let e = compile(KernelModule::Cast, "sm_1").unwrap_err();
    assert_eq!(e.module, "cast.cu");
    assert!(!e.to_string().is_empty());
}

#[test]
fn ptx_cache_round_trips_and_recovers_from_a_damaged_file() {
    if !nvrtc_or_skip("ptx_cache_round_trips") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("meshplan-ptx-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let m = KernelModule::Rope;
    let (first, cached) = compile_cached(m, "sm_90", Some(&dir)).unwrap();
    assert!(!cached, "an empty cache compiles");
    let (second, cached) = compile_cached(m, "sm_90", Some(&dir)).unwrap();
    assert!(cached, "the second call reads the file");
    assert_eq!(first, second);
    // Another architecture is another file.
    let (_, cached) = compile_cached(m, "sm_80", Some(&dir)).unwrap();
    assert!(!cached);
    let files = std::fs::read_dir(&dir).unwrap().flatten().count();
    assert_eq!(files, 2);
    // A truncated file is recompiled and replaced.
    let version = nvrtc_version().unwrap();
    let key = cache::key(m.source(), "sm_90", version, &compile::options("sm_90"));
    std::fs::write(cache::path(&dir, &key), &first[..first.len() / 3]).unwrap();
    let (third, cached) = compile_cached(m, "sm_90", Some(&dir)).unwrap();
    assert!(!cached);
    assert_eq!(third, first);
    assert_eq!(cache::read(&dir, &key).as_deref(), Some(first.as_str()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn probe_without_a_driver_names_what_is_missing() {
    // On a machine with a GPU this is the probe's success path instead.
    match probe() {
        Ok(info) => println!("probe found {info}"),
        Err(CudaUnavailable::MissingLibraries(libs)) => {
            let msg = CudaUnavailable::MissingLibraries(libs.clone()).to_string();
            assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
            assert!(!libs.is_empty());
            println!("probe: {msg}");
        }
        Err(e) => println!("probe: {e}"),
    }
}

// === GPU kernels against the CPU references ===

fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

fn from_bf16(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// The values the GPU actually sees: `x` rounded to bf16.
fn round_bf16(x: &[f32]) -> Vec<f32> {
    from_bf16(&to_bf16(x))
}

/// `|a - b| <= atol + rtol * |b|` elementwise, with the first offender named.
#[track_caller]
fn close(what: &str, a: &[f32], b: &[f32], atol: f32, rtol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        // Equal values pass (-inf log-sum-exps of rows that see no key included).
        assert!(
            x == y || (x - y).abs() <= atol + rtol * y.abs(),
            "{what}[{i}]: gpu {x} vs cpu {y}"
        );
    }
}

/// As [`close`], with the relative part taken of `mag`, the magnitude of the terms
/// summed into each value.
fn close_to_terms(what: &str, a: &[f32], b: &[f32], mag: &[f32], atol: f32, rtol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, ((&x, &y), &t)) in a.iter().zip(b).zip(mag).enumerate() {
        assert!(
            (x - y).abs() <= atol + rtol * t,
            "{what}[{i}]: gpu {x} vs cpu {y} (terms' magnitude {t})"
        );
    }
}

/// Tolerances: one bf16 rounding of the result (2^-8 relative) plus fp32 noise.
const BF16_RTOL: f32 = 1.0 / 128.0;

struct Dev<'a> {
    gpu: &'a Gpu,
}

impl Dev<'_> {
    fn b(&self, x: &[f32]) -> CudaSlice<bf16> {
        self.gpu.upload(&to_bf16(x)).unwrap()
    }
    fn f(&self, x: &[f32]) -> CudaSlice<f32> {
        self.gpu.upload(x).unwrap()
    }
    fn u(&self, x: &[u32]) -> CudaSlice<u32> {
        self.gpu.upload(x).unwrap()
    }
    fn gb(&self, x: &CudaSlice<bf16>) -> Vec<f32> {
        from_bf16(&self.gpu.download(x).unwrap())
    }
    fn gf(&self, x: &CudaSlice<f32>) -> Vec<f32> {
        self.gpu.download(x).unwrap()
    }
    fn gu(&self, x: &CudaSlice<u32>) -> Vec<u32> {
        self.gpu.download(x).unwrap()
    }
}

#[test]
fn gpu_gemm_matches_cpu_matmul_every_transpose() {
    let Some(gpu) = gpu_or_skip("gpu_gemm_matches_cpu_matmul_every_transpose") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(101);
    for (m, k, n) in [(7, 13, 5), (64, 128, 96), (1, 300, 33)] {
        for ta in [Transpose::No, Transpose::Yes] {
            for tb in [Transpose::No, Transpose::Yes] {
                let a = round_bf16(&rng.vec(m * k));
                let b = round_bf16(&rng.vec(k * n));
                let c0 = rng.vec(m * n);
                for beta in [0.0f32, 1.0] {
                    let mut want = c0.clone();
                    cpu::matmul(ta, tb, m, k, n, &a, &b, beta, &mut want).unwrap();
                    // fp32 output
                    let mut c = dev.f(&c0);
                    gpu.gemm(ta, tb, m, k, n, &dev.b(&a), &dev.b(&b), beta, &mut c)
                        .unwrap();
                    let tol = 1e-4 * (k as f32).sqrt();
                    close(
                        &format!("gemm f32 {m}x{k}x{n} {ta:?}{tb:?} b{beta}"),
                        &dev.gf(&c),
                        &want,
                        tol,
                        1e-4,
                    );
                    // bf16 output
                    let mut cb = dev.b(&c0);
                    gpu.gemm(ta, tb, m, k, n, &dev.b(&a), &dev.b(&b), beta, &mut cb)
                        .unwrap();
                    let c0_b = round_bf16(&c0);
                    let mut want_b = c0_b.clone();
                    cpu::matmul(ta, tb, m, k, n, &a, &b, beta, &mut want_b).unwrap();
                    // cuBLASLt may reduce partial products (split-K) in the output's
                    // type, so the bound is bf16 rounding of the terms' magnitude
                    // (sum |a||b| + |beta c|), the textbook dot-product bound, rather
                    // than of the (possibly cancelled) result.
                    let abs = |x: &[f32]| x.iter().map(|v| v.abs()).collect::<Vec<f32>>();
                    let mut mag: Vec<f32> = c0_b.iter().map(|v| beta * v.abs()).collect();
                    cpu::matmul(ta, tb, m, k, n, &abs(&a), &abs(&b), 1.0, &mut mag).unwrap();
                    close_to_terms(
                        &format!("gemm bf16 {m}x{k}x{n} {ta:?}{tb:?} b{beta}"),
                        &dev.gb(&cb),
                        &want_b,
                        &mag,
                        tol,
                        BF16_RTOL,
                    );
                }
            }
        }
    }
    // batched
    let (bt, m, k, n) = (3, 5, 8, 6);
    let a = round_bf16(&rng.vec(bt * m * k));
    let b = round_bf16(&rng.vec(bt * k * n));
    let mut want = vec![0.0; bt * m * n];
    cpu::matmul_batched(
        bt,
        Transpose::Yes,
        Transpose::No,
        m,
        k,
        n,
        &a,
        &b,
        0.0,
        &mut want,
    )
    .unwrap();
    let mut c = dev.f(&vec![f32::NAN; bt * m * n]);
    gpu.gemm_batched(
        bt,
        Transpose::Yes,
        Transpose::No,
        m,
        k,
        n,
        &dev.b(&a),
        &dev.b(&b),
        0.0,
        &mut c,
    )
    .unwrap();
    close("gemm batched", &dev.gf(&c), &want, 1e-4, 1e-4);
    // a length mismatch is an error, not a launch
    let e = gpu.gemm(
        Transpose::No,
        Transpose::No,
        2,
        2,
        2,
        &dev.b(&[0.0; 3]),
        &dev.b(&[0.0; 4]),
        0.0,
        &mut dev.f(&[0.0; 4]),
    );
    assert!(matches!(e, Err(GpuError::Args(_))));
}

#[test]
fn gpu_embedding_matches_cpu() {
    let Some(gpu) = gpu_or_skip("gpu_embedding_matches_cpu") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(102);
    // dim 64 takes the 16-byte path, dim 5 the scalar one.
    for (vocab, dim, n, start) in [(50, 64, 37, 10), (9, 5, 17, 0)] {
        let table = round_bf16(&rng.vec(vocab * dim));
        let ids: Vec<u32> = (0..n)
            .map(|_| rng.below((vocab + start + 5) as u64) as u32)
            .collect();
        let mut want = vec![0.0; n * dim];
        cpu::embedding_fwd(&ids, &table, start, dim, &mut want).unwrap();
        let mut out = dev.b(&vec![1.0; n * dim]);
        gpu.embedding_fwd(&dev.u(&ids), &dev.b(&table), start, dim, &mut out)
            .unwrap();
        assert_eq!(dev.gb(&out), want, "embedding fwd dim {dim}");

        let dy = round_bf16(&rng.vec(n * dim));
        let g0 = rng.vec(vocab * dim);
        let mut want = g0.clone();
        cpu::embedding_bwd(&ids, &dy, start, dim, &mut want).unwrap();
        let mut g = dev.f(&g0);
        gpu.embedding_bwd(&dev.u(&ids), &dev.b(&dy), start, dim, &mut g)
            .unwrap();
        close("embedding bwd", &dev.gf(&g), &want, 1e-5, 1e-5);
    }
}

#[test]
fn gpu_norms_match_cpu() {
    let Some(gpu) = gpu_or_skip("gpu_norms_match_cpu") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(103);
    for (rows, dim) in [(37, 256), (5, 7), (300, 1000)] {
        let x = round_bf16(
            &rng.vec(rows * dim)
                .iter()
                .map(|v| 2.0 * v + 0.5)
                .collect::<Vec<_>>(),
        );
        let w = round_bf16(
            &rng.vec(dim)
                .iter()
                .map(|v| 1.0 + 0.5 * v)
                .collect::<Vec<_>>(),
        );
        let bias = round_bf16(&rng.vec(dim));
        let dy = round_bf16(&rng.vec(rows * dim));
        let dx0 = round_bf16(&rng.vec(rows * dim));
        let eps = 1e-5;

        // LayerNorm
        let (mut y, mut mu, mut rs) = (vec![0.0; rows * dim], vec![0.0; rows], vec![0.0; rows]);
        cpu::layernorm_fwd(&x, &w, &bias, rows, dim, eps, &mut y, &mut mu, &mut rs).unwrap();
        let (mut gy, mut gmu, mut grs) = (dev.b(&y), dev.f(&mu), dev.f(&rs));
        gpu.layernorm_fwd(
            &dev.b(&x),
            &dev.b(&w),
            &dev.b(&bias),
            rows,
            dim,
            eps,
            &mut gy,
            &mut gmu,
            &mut grs,
        )
        .unwrap();
        close("ln y", &dev.gb(&gy), &y, 1e-2, BF16_RTOL);
        close("ln mean", &dev.gf(&gmu), &mu, 1e-5, 1e-4);
        close("ln rstd", &dev.gf(&grs), &rs, 1e-5, 1e-4);
        let (mut dx, mut dw, mut db) = (dx0.clone(), vec![0.5; dim], vec![0.25; dim]);
        cpu::layernorm_bwd(&x, &w, &mu, &rs, &dy, rows, dim, &mut dx, &mut dw, &mut db).unwrap();
        let (mut gdx, mut gdw, mut gdb) = (
            dev.b(&dx0),
            dev.f(&[0.5; 1000][..dim]),
            dev.f(&[0.25; 1000][..dim]),
        );
        gpu.layernorm_bwd(
            &dev.b(&x),
            &dev.b(&w),
            &dev.f(&mu),
            &dev.f(&rs),
            &dev.b(&dy),
            rows,
            dim,
            &mut gdx,
            &mut gdw,
            &mut gdb,
        )
        .unwrap();
        close("ln dx", &dev.gb(&gdx), &dx, 2e-2, BF16_RTOL);
        close("ln dw", &dev.gf(&gdw), &dw, 1e-3, 1e-3);
        close("ln db", &dev.gf(&gdb), &db, 1e-3, 1e-3);

        // RMSNorm
        let (mut y, mut rs) = (vec![0.0; rows * dim], vec![0.0; rows]);
        cpu::rmsnorm_fwd(&x, &w, rows, dim, eps, &mut y, &mut rs).unwrap();
        let (mut gy, mut grs) = (dev.b(&y), dev.f(&rs));
        gpu.rmsnorm_fwd(&dev.b(&x), &dev.b(&w), rows, dim, eps, &mut gy, &mut grs)
            .unwrap();
        close("rms y", &dev.gb(&gy), &y, 1e-2, BF16_RTOL);
        close("rms rstd", &dev.gf(&grs), &rs, 1e-5, 1e-4);
        let (mut dx, mut dw) = (dx0.clone(), vec![0.5; dim]);
        cpu::rmsnorm_bwd(&x, &w, &rs, &dy, rows, dim, &mut dx, &mut dw).unwrap();
        let (mut gdx, mut gdw) = (dev.b(&dx0), dev.f(&[0.5; 1000][..dim]));
        gpu.rmsnorm_bwd(
            &dev.b(&x),
            &dev.b(&w),
            &dev.f(&rs),
            &dev.b(&dy),
            rows,
            dim,
            &mut gdx,
            &mut gdw,
        )
        .unwrap();
        close("rms dx", &dev.gb(&gdx), &dx, 2e-2, BF16_RTOL);
        close("rms dw", &dev.gf(&gdw), &dw, 1e-3, 1e-3);
    }
}

#[test]
fn gpu_rope_matches_cpu() {
    let Some(gpu) = gpu_or_skip("gpu_rope_matches_cpu") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(104);
    let (tokens, heads, hd, theta) = (19, 4, 64, cpu::Rope::plain(500_000.0));
    let x = round_bf16(&rng.vec(tokens * heads * hd));
    let pos: Vec<u32> = (0..tokens as u32).map(|t| t * 977 + 3).collect();
    let mut want = vec![0.0; x.len()];
    cpu::rope_fwd(&x, &pos, tokens, heads, hd, theta, &mut want).unwrap();
    let mut out = dev.b(&vec![0.0; x.len()]);
    gpu.rope_fwd(&dev.b(&x), &dev.u(&pos), tokens, heads, hd, theta, &mut out)
        .unwrap();
    close("rope fwd", &dev.gb(&out), &want, 1e-2, BF16_RTOL);
    let d0 = round_bf16(&rng.vec(x.len()));
    let mut want = d0.clone();
    cpu::rope_bwd(&x, &pos, tokens, heads, hd, theta, &mut want).unwrap();
    let mut dx = dev.b(&d0);
    gpu.rope_bwd(&dev.b(&x), &dev.u(&pos), tokens, heads, hd, theta, &mut dx)
        .unwrap();
    close("rope bwd", &dev.gb(&dx), &want, 2e-2, BF16_RTOL);
}

#[test]
fn gpu_pointwise_and_casts_match_cpu() {
    let Some(gpu) = gpu_or_skip("gpu_pointwise_and_casts_match_cpu") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(105);
    // 1003: an aligned 8-wide body and a scalar tail.
    let n = 1003;
    let x = round_bf16(&rng.vec(n).iter().map(|v| 4.0 * v).collect::<Vec<_>>());
    let dy = round_bf16(&rng.vec(n));
    let d0 = round_bf16(&rng.vec(n));

    let mut want = vec![0.0; n];
    cpu::gelu_fwd(&x, &mut want).unwrap();
    let mut y = dev.b(&vec![0.0; n]);
    gpu.gelu_fwd(&dev.b(&x), &mut y).unwrap();
    close("gelu fwd", &dev.gb(&y), &want, 1e-2, BF16_RTOL);
    let mut want = d0.clone();
    cpu::gelu_bwd(&x, &dy, &mut want).unwrap();
    let mut dx = dev.b(&d0);
    gpu.gelu_bwd(&dev.b(&x), &dev.b(&dy), &mut dx).unwrap();
    close("gelu bwd", &dev.gb(&dx), &want, 2e-2, BF16_RTOL);

    let (rows, f) = (7, 33);
    let xs = round_bf16(
        &rng.vec(rows * 2 * f)
            .iter()
            .map(|v| 3.0 * v)
            .collect::<Vec<_>>(),
    );
    let mut want = vec![0.0; rows * f];
    cpu::swiglu_fwd(&xs, rows, f, &mut want).unwrap();
    let mut y = dev.b(&vec![0.0; rows * f]);
    gpu.swiglu_fwd(&dev.b(&xs), rows, f, &mut y).unwrap();
    close("swiglu fwd", &dev.gb(&y), &want, 1e-2, BF16_RTOL);
    let dys = round_bf16(&rng.vec(rows * f));
    let ds0 = round_bf16(&rng.vec(rows * 2 * f));
    let mut want = ds0.clone();
    cpu::swiglu_bwd(&xs, &dys, rows, f, &mut want).unwrap();
    let mut dx = dev.b(&ds0);
    gpu.swiglu_bwd(&dev.b(&xs), &dev.b(&dys), rows, f, &mut dx)
        .unwrap();
    close("swiglu bwd", &dev.gb(&dx), &want, 2e-2, BF16_RTOL);

    let mut want = vec![0.0; n];
    cpu::add(&x, &dy, &mut want).unwrap();
    let mut out = dev.b(&vec![0.0; n]);
    gpu.add(&dev.b(&x), &dev.b(&dy), &mut out).unwrap();
    close("add", &dev.gb(&out), &want, 1e-2, BF16_RTOL);
    let (mut wa, mut wb) = (d0.clone(), x.clone());
    cpu::add_bwd(&dy, &mut wa, &mut wb).unwrap();
    let (mut da, mut db) = (dev.b(&d0), dev.b(&x));
    gpu.add_bwd(&dev.b(&dy), &mut da, &mut db).unwrap();
    close("add bwd a", &dev.gb(&da), &wa, 1e-2, BF16_RTOL);
    close("add bwd b", &dev.gb(&db), &wb, 1e-2, BF16_RTOL);

    // Casts: bf16 rounding equals half's (round to nearest even), NaN and inf kept.
    let mut v = rng.vec(n);
    v[0] = f32::INFINITY;
    v[1] = f32::NEG_INFINITY;
    v[2] = 1.0 + 1.0 / 256.0; // a tie: rounds to even (1.0)
    let mut yb = dev.b(&vec![0.0; n]);
    gpu.cast_f32_to_bf16(&dev.f(&v), &mut yb).unwrap();
    let got: Vec<u16> = gpu
        .download(&yb)
        .unwrap()
        .iter()
        .map(|b| b.to_bits())
        .collect();
    let want: Vec<u16> = to_bf16(&v).iter().map(|b| b.to_bits()).collect();
    assert_eq!(got, want);
    let mut yf = dev.f(&vec![0.0; n]);
    gpu.cast_bf16_to_f32(&yb, &mut yf).unwrap();
    assert_eq!(dev.gf(&yf), from_bf16(&to_bf16(&v)));
    let mut acc = dev.b(&d0);
    gpu.add_f32_into_bf16(&dev.f(&x), &mut acc).unwrap();
    let want: Vec<f32> = d0.iter().zip(&x).map(|(a, b)| a + b).collect();
    close("add f32 into bf16", &dev.gb(&acc), &want, 1e-2, BF16_RTOL);
}

#[test]
fn gpu_fused_cross_entropy_matches_cpu() {
    let Some(gpu) = gpu_or_skip("gpu_fused_cross_entropy_matches_cpu") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(106);
    // vocab 50257 (GPT-2): odd, so rows are not 16-byte aligned; 32000 is.
    for (rows, vocab) in [(9, 50_257), (4, 32_000), (3, 5)] {
        let logits = round_bf16(
            &rng.vec(rows * vocab)
                .iter()
                .map(|v| 6.0 * v)
                .collect::<Vec<_>>(),
        );
        let mut labels: Vec<u32> = (0..rows).map(|_| rng.below(vocab as u64) as u32).collect();
        labels[0] = vocab as u32 + 7; // outside: no target term, no onehot
        let scale = 1.0 / rows as f32;
        let (mut mx, mut se, mut tg, mut want_loss) = (
            vec![0.0; rows],
            vec![0.0; rows],
            vec![0.0; rows],
            vec![0.0; rows],
        );
        cpu::ce_row_max(&logits, rows, vocab, &mut mx).unwrap();
        cpu::ce_row_sumexp(&logits, rows, vocab, &mx, &mut se).unwrap();
        cpu::ce_target_logit(&logits, &labels, rows, vocab, 0, &mut tg).unwrap();
        cpu::ce_loss(&mx, &se, &tg, &mut want_loss).unwrap();
        let mut want_d = vec![0.0; rows * vocab];
        cpu::ce_bwd(
            &logits,
            rows,
            vocab,
            &mx,
            &se,
            &labels,
            0,
            scale,
            &mut want_d,
        )
        .unwrap();
        let mut loss = dev.f(&vec![0.0; rows]);
        let mut d = dev.b(&vec![1.0; rows * vocab]);
        gpu.ce_fused(
            &dev.b(&logits),
            &dev.u(&labels),
            rows,
            vocab,
            scale,
            &mut loss,
            &mut d,
        )
        .unwrap();
        close("ce loss", &dev.gf(&loss), &want_loss, 1e-4, 1e-4);
        close("ce dlogits", &dev.gb(&d), &want_d, 1e-6, BF16_RTOL);
    }
}

/// Ring attention's merge of a block into the running output, rows that saw no key
/// on either side included.
#[test]
fn gpu_attention_merge_matches_cpu() {
    let Some(gpu) = gpu_or_skip("gpu_attention_merge_matches_cpu") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(113);
    let dims = AttnDims {
        batch: 2,
        sq: 5,
        sk: 5,
        hq: 3,
        hkv: 1,
        d: 8,
        dv: 40,
    };
    let (ol, ll) = (2 * 5 * 3 * 40, 2 * 3 * 5);
    let (oa, ob) = (round_bf16(&rng.vec(ol)), round_bf16(&rng.vec(ol)));
    let mut la: Vec<f32> = rng.vec(ll).iter().map(|x| 3.0 * x).collect();
    let mut lb: Vec<f32> = rng.vec(ll).iter().map(|x| 3.0 * x).collect();
    (la[1], lb[2], la[4], lb[4]) = (
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
    );
    let (mut want_o, mut want_l) = (oa.clone(), la.clone());
    cpu::attention_merge(&dims, &mut want_o, &mut want_l, &ob, &lb).unwrap();
    let (mut go, mut gl) = (dev.b(&oa), dev.f(&la));
    gpu.attention_merge(&dims, &mut go, &mut gl, &dev.b(&ob), &dev.f(&lb))
        .unwrap();
    close("merge out", &dev.gb(&go), &want_o, 1e-2, BF16_RTOL);
    let got_l = dev.gf(&gl);
    assert_eq!(got_l[4], f32::NEG_INFINITY, "a row no block saw stays -inf");
    close("merge lse", &got_l, &want_l, 1e-5, 1e-5);
}

/// The vocabulary-parallel cross-entropy over two shards, each on its own buffers,
/// with the statistics summed between the parts as the program sums them over the
/// tensor ranks (the maxima's sum halved to their mean).
#[test]
fn gpu_sharded_cross_entropy_matches_cpu() {
    let Some(gpu) = gpu_or_skip("gpu_sharded_cross_entropy_matches_cpu") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(109);
    // 25_129 per shard (GPT-2's 50_257 padded to 50_258 over two): unaligned rows.
    for (rows, v_local) in [(5, 25_129), (4, 16_000), (3, 7)] {
        let shards: Vec<Vec<f32>> = (0..2)
            .map(|_| {
                round_bf16(
                    &rng.vec(rows * v_local)
                        .iter()
                        .map(|v| 6.0 * v)
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        let mut labels: Vec<u32> = (0..rows)
            .map(|_| rng.below(2 * v_local as u64) as u32)
            .collect();
        labels[0] = 2 * v_local as u32 + 3; // no shard holds it
        let scale = 1.0 / rows as f32;
        let sum = |parts: &[Vec<f32>]| -> Vec<f32> {
            (0..rows).map(|r| parts[0][r] + parts[1][r]).collect()
        };
        // The CPU's parts.
        let maxes: Vec<Vec<f32>> = shards
            .iter()
            .map(|l| {
                let mut m = vec![0.0; rows];
                cpu::ce_row_max(l, rows, v_local, &mut m).unwrap();
                m
            })
            .collect();
        let max: Vec<f32> = sum(&maxes).iter().map(|m| m * 0.5).collect();
        let (mut ses, mut tgs) = (Vec::new(), Vec::new());
        for (i, l) in shards.iter().enumerate() {
            let (mut se, mut tg) = (vec![0.0; rows], vec![0.0; rows]);
            cpu::ce_row_sumexp(l, rows, v_local, &max, &mut se).unwrap();
            cpu::ce_target_logit(l, &labels, rows, v_local, i * v_local, &mut tg).unwrap();
            ses.push(se);
            tgs.push(tg);
        }
        let (se, tg) = (sum(&ses), sum(&tgs));
        let mut want_loss = vec![0.0; rows];
        cpu::ce_loss(&max, &se, &tg, &mut want_loss).unwrap();
        // The GPU's, shard by shard.
        let g_labels = dev.u(&labels);
        let mut g_max = Vec::new();
        for l in &shards {
            let mut m = dev.f(&vec![1.0; rows]);
            gpu.ce_row_max(&dev.b(l), rows, v_local, &mut m).unwrap();
            g_max.push(dev.gf(&m));
        }
        close("ce shard max", &g_max[0], &maxes[0], 0.0, 0.0);
        close("ce shard max", &g_max[1], &maxes[1], 0.0, 0.0);
        let mut g_mean = dev.f(&g_max[0]);
        gpu.add_f32(&dev.f(&g_max[1]), &mut g_mean).unwrap();
        close("add", &dev.gf(&g_mean), &sum(&g_max), 0.0, 0.0);
        gpu.scale_f32(&mut g_mean, 0.5).unwrap();
        close("scale", &dev.gf(&g_mean), &max, 0.0, 0.0);
        let (mut g_se, mut g_tg) = (Vec::new(), Vec::new());
        for (i, l) in shards.iter().enumerate() {
            let (mut a, mut b) = (dev.f(&vec![1.0; rows]), dev.f(&vec![1.0; rows]));
            gpu.ce_sumexp_target(
                &dev.b(l),
                &g_labels,
                rows,
                v_local,
                i * v_local,
                &g_mean,
                &mut a,
                &mut b,
            )
            .unwrap();
            g_se.push(dev.gf(&a));
            g_tg.push(dev.gf(&b));
        }
        close("ce shard sumexp", &g_se[0], &ses[0], 1e-4, 1e-4);
        close("ce shard target", &g_tg[1], &tgs[1], 0.0, 0.0);
        let stats = [dev.f(&max), dev.f(&sum(&g_se)), dev.f(&sum(&g_tg))];
        for (i, l) in shards.iter().enumerate() {
            let mut want_d = vec![0.0; rows * v_local];
            cpu::ce_bwd(
                l,
                rows,
                v_local,
                &max,
                &se,
                &labels,
                i * v_local,
                scale,
                &mut want_d,
            )
            .unwrap();
            let mut loss = dev.f(&vec![0.0; rows]);
            let mut d = dev.b(&vec![1.0; rows * v_local]);
            gpu.ce_finish(
                &dev.b(l),
                &g_labels,
                rows,
                v_local,
                i * v_local,
                scale,
                [&stats[0], &stats[1], &stats[2]],
                &mut loss,
                &mut d,
            )
            .unwrap();
            close("ce shard loss", &dev.gf(&loss), &want_loss, 1e-4, 1e-4);
            close("ce shard dlogits", &dev.gb(&d), &want_d, 1e-6, BF16_RTOL);
        }
    }
}

#[test]
fn gpu_argmax_picks_what_the_cpu_picks() {
    let Some(gpu) = gpu_or_skip("gpu_argmax_picks_what_the_cpu_picks") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(107);
    // GPT-2's vocabulary over 4 shards padded to 50,304; Llama 3's over 1; ties from
    // a coarse grid; a NaN first logit; a row of -inf.
    for (parts, rows, cols, limit) in [
        (4, 5, 12_576, 50_257),
        (1, 3, 128_256, 128_256),
        (2, 4, 3, 5),
    ] {
        let mut x: Vec<f32> = rng
            .vec(parts * rows * cols)
            .iter()
            .map(|v| (4.0 * v).round())
            .collect();
        x[cols] = f32::NAN; // row 1's first logit (shard 0)
        if rows > 2 {
            for p in 0..parts {
                x[(p * rows + 2) * cols..(p * rows + 3) * cols].fill(f32::NEG_INFINITY);
            }
        }
        x[(parts * rows - 1) * cols + 1] = f32::NAN; // a NaN past the first
        let d = cpu::Picks {
            parts,
            rows,
            cols,
            limit,
        };
        let mut t = dev.u(&vec![u32::MAX; rows]);
        gpu.argmax_parts(&dev.f(&x), d, &mut t).unwrap();
        assert_eq!(dev.gu(&t), cpu::argmax_parts(&x, d).unwrap(), "{d:?}");
    }
}

#[test]
fn gpu_sampling_draws_what_the_cpu_draws() {
    let Some(gpu) = gpu_or_skip("gpu_sampling_draws_what_the_cpu_draws") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(109);
    // GPT-2's vocabulary over 4 shards padded to 50,304; Llama 3's over 1; a few
    // columns. Ties from a coarse grid (equal weights go by column); rows with a
    // NaN, a row of -inf and one with +inf.
    for (parts, rows, cols, limit) in [
        (4, 6, 12_576, 50_257),
        (1, 4, 128_256, 128_256),
        (2, 5, 3, 5),
    ] {
        let mut x: Vec<f32> = rng
            .vec(parts * rows * cols)
            .iter()
            .map(|v| (8.0 * v).round())
            .collect();
        x[cols] = f32::NAN;
        for p in 0..parts {
            x[(p * rows + 2) * cols..(p * rows + 3) * cols].fill(f32::NEG_INFINITY);
        }
        x[3 * cols + 1] = f32::INFINITY;
        let d = cpu::Picks {
            parts,
            rows,
            cols,
            limit,
        };
        let requests: Vec<u32> = (0..rows as u32).map(|r| 3 * r + 1).collect();
        for (temperature, top_p) in [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5), (0.2, 0.99)] {
            for step in 0..4 {
                let s = cpu::Nucleus {
                    temperature,
                    top_p,
                    seed: 17,
                    step,
                };
                let mut t = dev.u(&vec![u32::MAX; rows]);
                gpu.sample_parts(&dev.f(&x), d, s, &dev.u(&requests), &mut t)
                    .unwrap();
                let want = cpu::sample_parts(&x, d, s, &requests).unwrap();
                assert_eq!(dev.gu(&t), want, "{d:?} {s:?}");
            }
        }
    }
}

#[test]
fn gpu_adamw_matches_cpu_and_writes_the_bf16_copy() {
    let Some(gpu) = gpu_or_skip("gpu_adamw_matches_cpu") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(107);
    let n = 1001;
    let (mut p, mut m, mut v) = (rng.vec(n), vec![0.0; n], vec![0.0; n]);
    let (mut gp, mut gm, mut gv) = (dev.f(&p), dev.f(&m), dev.f(&v));
    let mut pb = dev.b(&vec![0.0; n]);
    for step in 1..=3u64 {
        let g = rng.vec(n);
        cpu::adamw_step(&mut p, &g, &mut m, &mut v, step, 1e-3, 0.9, 0.95, 1e-8, 0.1).unwrap();
        gpu.adamw_step(
            &mut gp,
            &dev.f(&g),
            &mut gm,
            &mut gv,
            &mut pb,
            step,
            1e-3,
            0.9,
            0.95,
            1e-8,
            0.1,
        )
        .unwrap();
    }
    close("adamw param", &dev.gf(&gp), &p, 1e-6, 1e-5);
    close("adamw m", &dev.gf(&gm), &m, 1e-7, 1e-5);
    close("adamw v", &dev.gf(&gv), &v, 1e-9, 1e-5);
    assert_eq!(dev.gb(&pb), round_bf16(&dev.gf(&gp)));
}

fn attn_case(gpu: &Gpu, seed: u64, dims: AttnDims, q_pos0: usize, k_pos0: usize, causal: bool) {
    attn_case_dropout(gpu, seed, dims, q_pos0, k_pos0, causal, None)
}

fn attn_case_dropout(
    gpu: &Gpu,
    seed: u64,
    dims: AttnDims,
    q_pos0: usize,
    k_pos0: usize,
    causal: bool,
    dropout: Option<AttnDropout>,
) {
    let dev = Dev { gpu };
    let keep = |b, h, i, j| dropout.is_some_and(|a| a.keep(b, h, i, j));
    let cpu_drop = dropout.map(|a| cpu::Dropout {
        p: a.draw.p as f32,
        keep: &keep,
    });
    let mut rng = Rng::new(seed);
    let AttnDims {
        batch,
        sq,
        sk,
        hq,
        hkv,
        d,
        dv,
    } = dims;
    let q = round_bf16(&rng.vec(batch * sq * hq * d));
    let k = round_bf16(&rng.vec(batch * sk * hkv * d));
    let v = round_bf16(&rng.vec(batch * sk * hkv * dv));
    let scale = 1.0 / (d as f32).sqrt();
    let what = format!(
        "attention {dims:?} q_pos0 {q_pos0} k_pos0 {k_pos0} causal {causal} dropout {dropout:?}"
    );
    let (mut o, mut lse) = (vec![0.0; batch * sq * hq * dv], vec![0.0; batch * hq * sq]);
    cpu::attention_fwd(
        &dims,
        &q,
        &k,
        &v,
        q_pos0,
        k_pos0,
        causal,
        scale,
        &mut o,
        &mut lse,
        cpu_drop.as_ref(),
    )
    .unwrap();
    let (gq, gk, gv) = (dev.b(&q), dev.b(&k), dev.b(&v));
    let mut go = dev.b(&vec![1.0; o.len()]);
    let mut glse = dev.f(&vec![0.0; lse.len()]);
    gpu.attention_fwd(
        &dims,
        &gq,
        &gk,
        &gv,
        q_pos0,
        k_pos0,
        causal,
        scale,
        dropout.as_ref(),
        &mut go,
        &mut glse,
    )
    .unwrap();
    let o_gpu = dev.gb(&go);
    close(&format!("{what}: out"), &o_gpu, &o, 1e-2, BF16_RTOL);
    close(&format!("{what}: lse"), &dev.gf(&glse), &lse, 1e-4, 1e-4);

    // Backward from the GPU's own (bf16) output, on both sides.
    let d_o = round_bf16(&rng.vec(o.len()));
    let (mut dq, mut dk, mut dvv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    cpu::attention_bwd(
        &dims,
        &q,
        &k,
        &v,
        &o_gpu,
        &lse,
        &d_o,
        q_pos0,
        k_pos0,
        causal,
        scale,
        &mut dq,
        &mut dk,
        &mut dvv,
        cpu_drop.as_ref(),
    )
    .unwrap();
    let (mut gdq, mut gdk, mut gdv) = (
        dev.b(&vec![0.0; q.len()]),
        dev.b(&vec![0.0; k.len()]),
        dev.b(&vec![0.0; v.len()]),
    );
    gpu.attention_bwd(
        &dims,
        &gq,
        &gk,
        &gv,
        &go,
        &dev.f(&lse),
        &dev.b(&d_o),
        q_pos0,
        k_pos0,
        causal,
        scale,
        dropout.as_ref(),
        &mut gdq,
        &mut gdk,
        &mut gdv,
    )
    .unwrap();
    let scale_of = |x: &[f32]| x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (tq, tk, tv) = (scale_of(&dq), scale_of(&dk), scale_of(&dvv));
    close(
        &format!("{what}: dq"),
        &dev.gb(&gdq),
        &dq,
        2e-2 * tq,
        2.0 * BF16_RTOL,
    );
    close(
        &format!("{what}: dk"),
        &dev.gb(&gdk),
        &dk,
        2e-2 * tk,
        2.0 * BF16_RTOL,
    );
    close(
        &format!("{what}: dv"),
        &dev.gb(&gdv),
        &dvv,
        2e-2 * tv,
        2.0 * BF16_RTOL,
    );
}

#[test]
fn gpu_attention_matches_cpu_causal_gqa_offsets_and_head_dims() {
    let Some(gpu) = gpu_or_skip("gpu_attention_matches_cpu") else {
        return;
    };
    let dims = |batch, sq, sk, hq, hkv, d, dv| AttnDims {
        batch,
        sq,
        sk,
        hq,
        hkv,
        d,
        dv,
    };
    // Causal training shapes, GQA 4:1 and 1:1, head dims 64 and 128.
    attn_case(&gpu, 201, dims(2, 100, 100, 8, 2, 64, 64), 0, 0, true);
    attn_case(&gpu, 202, dims(1, 77, 77, 4, 4, 128, 128), 0, 0, true);
    // Non-causal, odd sizes, d != dv.
    attn_case(&gpu, 203, dims(2, 7, 150, 8, 2, 5, 3), 0, 0, false);
    // A ring block: queries after the keys, and keys after some queries.
    attn_case(&gpu, 204, dims(1, 40, 70, 4, 1, 32, 32), 75, 0, true);
    attn_case(&gpu, 205, dims(1, 40, 30, 2, 1, 16, 16), 3, 20, true);
    // Decode: one query at the end of a cached context.
    attn_case(&gpu, 206, dims(3, 1, 300, 8, 1, 64, 64), 299, 0, true);
    // Head dim 256 (the `_256` kernels, opting into more shared memory).
    attn_case(&gpu, 207, dims(1, 33, 33, 2, 1, 256, 256), 0, 0, true);
    // The tensor-core kernels over several query and key tiles: GQA 2:1 at GPT-2's
    // head dim, a partial last tile; non-causal with more keys than queries.
    attn_case(&gpu, 208, dims(2, 200, 200, 12, 6, 64, 64), 0, 0, true);
    attn_case(&gpu, 209, dims(1, 70, 130, 4, 2, 128, 128), 0, 0, false);
    // Head dim 64 on the scalar kernels (d != dv), to keep them tested at that size.
    attn_case(&gpu, 210, dims(1, 90, 90, 4, 2, 64, 32), 0, 0, true);
}

#[test]
fn gpu_attention_dropout_draws_the_cpu_mask() {
    let Some(gpu) = gpu_or_skip("gpu_attention_dropout_draws_the_cpu_mask") else {
        return;
    };
    let drop = |p, head0, sample0| AttnDropout {
        draw: DropoutDraw {
            seed: 17,
            step: 3,
            site: 0xa77e_0000 ^ 5,
            p,
        },
        head0,
        sample0,
    };
    let dims = |batch, sq, sk, hq, hkv, d| AttnDims {
        batch,
        sq,
        sk,
        hq,
        hkv,
        d,
        dv: d,
    };
    // GQA, a second tensor rank's heads and a later sample; a ring block with
    // offset positions; a high drop rate.
    let cases = [
        (dims(2, 70, 70, 8, 2, 64), 0, 0, drop(0.1, 8, 4)),
        (dims(1, 40, 30, 4, 1, 32), 45, 20, drop(0.1, 0, 0)),
        (dims(1, 33, 33, 2, 2, 128), 0, 0, drop(0.5, 2, 1)),
    ];
    for (i, (dm, q0, k0, dr)) in cases.into_iter().enumerate() {
        attn_case_dropout(&gpu, 301 + i as u64, dm, q0, k0, true, Some(dr));
    }
}

#[test]
fn gpu_dropout_rows_equal_the_cpu_bit_for_bit() {
    let Some(gpu) = gpu_or_skip("gpu_dropout_rows_equal_the_cpu_bit_for_bit") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(401);
    for (rows, width, p, mbs) in [(96, 200, 0.1, 2), (7, 33, 0.5, 1), (64, 1, 0.9, 4)] {
        let d = RowDropout {
            draw: DropoutDraw {
                seed: 9,
                step: 2,
                site: 77,
                p,
            },
            sample0: 6,
            mbs,
            pos0: 32,
        };
        let x = round_bf16(&rng.vec(rows * width));
        let mut y = vec![0.0; x.len()];
        cpu::dropout_rows(&x, rows, width, &d, &mut y).unwrap();
        let mut gy = dev.b(&vec![1.0; x.len()]);
        gpu.dropout_rows(&dev.b(&x), rows, width, &d, &mut gy)
            .unwrap();
        // A survivor is x * scale rounded to bf16 once on both sides.
        assert_eq!(
            dev.gb(&gy),
            round_bf16(&y),
            "rows {rows} width {width} p {p}"
        );
    }
    let bad = RowDropout {
        draw: DropoutDraw {
            seed: 0,
            step: 0,
            site: 0,
            p: 1.0,
        },
        sample0: 0,
        mbs: 1,
        pos0: 0,
    };
    let e = gpu.dropout_rows(&dev.b(&[1.0; 4]), 2, 2, &bad, &mut dev.b(&[0.0; 4]));
    assert!(matches!(e, Err(GpuError::Args(_))), "{e:?}");
}

/// Capacities over `tokens` tokens: groups of every divisor up to 8 and the
/// whole, one slot to more than a group holds (nothing dropped).
fn capacities(tokens: usize) -> Vec<cpu::Capacity> {
    let groups = (1..=8)
        .chain([tokens])
        .filter(|&g| g > 0 && tokens.is_multiple_of(g));
    let each = |group| [1, 2, 3 * group].map(|cap| cpu::Capacity { group, cap });
    groups.flat_map(each).collect()
}

#[test]
fn gpu_moe_matches_cpu() {
    let Some(gpu) = gpu_or_skip("gpu_moe_matches_cpu") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(108);
    for (tokens, experts, k, renorm, dim) in [
        (37, 8, 2, true, 64),
        (50, 40, 3, false, 7),
        (9, 4, 1, true, 16),
        // Experts of more slots than a block has threads.
        (600, 2, 2, true, 8),
    ] {
        let logits: Vec<f32> = rng.vec(tokens * experts).iter().map(|v| 3.0 * v).collect();
        let (mut p, mut idx, mut w) = (
            vec![0.0; tokens * experts],
            vec![0; tokens * k],
            vec![0.0; tokens * k],
        );
        cpu::moe_route_fwd(
            &logits, tokens, experts, k, renorm, &mut p, &mut idx, &mut w,
        )
        .unwrap();
        let (mut gp, mut gidx, mut gw) = (dev.f(&p), dev.u(&idx), dev.f(&w));
        gpu.moe_route_fwd(
            &dev.f(&logits),
            tokens,
            experts,
            k,
            renorm,
            &mut gp,
            &mut gidx,
            &mut gw,
        )
        .unwrap();
        assert_eq!(dev.gu(&gidx), idx, "route: expert choice");
        close("route probs", &dev.gf(&gp), &p, 1e-6, 1e-5);
        close("route weights", &dev.gf(&gw), &w, 1e-6, 1e-5);
        let dw = rng.vec(tokens * k);
        let dl0 = rng.vec(tokens * experts);
        let mut want = dl0.clone();
        cpu::moe_route_bwd(&p, &idx, &w, &dw, tokens, experts, k, renorm, &mut want).unwrap();
        let mut gdl = dev.f(&dl0);
        gpu.moe_route_bwd(
            &dev.f(&p),
            &dev.u(&idx),
            &dev.f(&w),
            &dev.f(&dw),
            tokens,
            experts,
            k,
            renorm,
            &mut gdl,
        )
        .unwrap();
        close("route bwd", &dev.gf(&gdl), &want, 1e-6, 1e-5);

        let n = tokens * k;
        let x = round_bf16(&rng.vec(tokens * dim));
        let (mut out, mut counts, mut perm) =
            (vec![0.0; n * dim], vec![0usize; experts], vec![0u32; n]);
        cpu::moe_dispatch_fwd(
            &x,
            &idx,
            tokens,
            k,
            experts,
            dim,
            &mut out,
            &mut counts,
            &mut perm,
        )
        .unwrap();
        let (mut gout, mut gcounts, mut gperm) = (
            dev.b(&vec![0.0; n * dim]),
            dev.u(&vec![0; experts]),
            dev.u(&vec![0; n]),
        );
        gpu.moe_dispatch_fwd(
            &dev.b(&x),
            &dev.u(&idx),
            tokens,
            k,
            experts,
            dim,
            &mut gout,
            &mut gcounts,
            &mut gperm,
        )
        .unwrap();
        assert_eq!(dev.gu(&gperm), perm, "dispatch perm");
        let counts32: Vec<u32> = counts.iter().map(|&c| c as u32).collect();
        assert_eq!(dev.gu(&gcounts), counts32, "dispatch counts");
        assert_eq!(dev.gb(&gout), out, "dispatch rows");
        for c in capacities(tokens) {
            let per_expert = c.per_expert(tokens);
            let (mut at, mut pad, mut kept) =
                (vec![0; n], vec![0; experts * per_expert], vec![0; experts]);
            cpu::moe_capacity(&perm, &counts, k, c, (&mut at, &mut pad), &mut kept).unwrap();
            let (mut gat, mut gpad, mut gkept) = (
                dev.u(&vec![7; n]),
                dev.u(&vec![7; experts * per_expert]),
                dev.u(&vec![7; experts]),
            );
            let on = (&gperm, &gcounts);
            (gpu.moe_capacity(on, k, c, (&mut gat, &mut gpad), &mut gkept)).unwrap();
            assert_eq!(dev.gu(&gat), at, "capacity {c:?}: at");
            assert_eq!(dev.gu(&gpad), pad, "capacity {c:?}: pad");
            let kept32: Vec<u32> = kept.iter().map(|&c| c as u32).collect();
            assert_eq!(dev.gu(&gkept), kept32, "capacity {c:?}: kept");
        }

        let d_out = round_bf16(&rng.vec(n * dim));
        let dx0 = round_bf16(&rng.vec(tokens * dim));
        let mut want = dx0.clone();
        cpu::moe_dispatch_bwd(&d_out, &perm, tokens, k, dim, &mut want).unwrap();
        let mut gdx = dev.b(&dx0);
        gpu.moe_dispatch_bwd(&dev.b(&d_out), &gperm, tokens, k, dim, &mut gdx)
            .unwrap();
        close("dispatch bwd", &dev.gb(&gdx), &want, 1e-2, BF16_RTOL);

        let y = round_bf16(&rng.vec(n * dim));
        let mut want = vec![0.0; tokens * dim];
        cpu::moe_combine_fwd(&y, &perm, &w, tokens, k, dim, &mut want).unwrap();
        let mut gc = dev.b(&vec![1.0; tokens * dim]);
        gpu.moe_combine_fwd(&dev.b(&y), &gperm, &dev.f(&w), tokens, k, dim, &mut gc)
            .unwrap();
        close("combine fwd", &dev.gb(&gc), &want, 1e-2, BF16_RTOL);

        let g = round_bf16(&rng.vec(tokens * dim));
        let dy0 = round_bf16(&rng.vec(n * dim));
        let dw0 = rng.vec(n);
        let (mut wdy, mut wdw) = (dy0.clone(), dw0.clone());
        cpu::moe_combine_bwd(&g, &y, &perm, &w, tokens, k, dim, &mut wdy, &mut wdw).unwrap();
        let (mut gdy, mut gdw) = (dev.b(&dy0), dev.f(&dw0));
        gpu.moe_combine_bwd(
            &dev.b(&g),
            &dev.b(&y),
            &gperm,
            &dev.f(&w),
            tokens,
            k,
            dim,
            &mut gdy,
            &mut gdw,
        )
        .unwrap();
        close("combine bwd dy", &dev.gb(&gdy), &wdy, 1e-2, BF16_RTOL);
        close("combine bwd dw", &dev.gf(&gdw), &wdw, 1e-4, 1e-4);
    }
}

#[test]
fn gpu_layout_kernels_match_host() {
    let Some(gpu) = gpu_or_skip("gpu_layout_kernels_match_host") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(107);

    // Fused QKV split and join: exact copies. d 16 and dv 8 take the 16-byte path,
    // d 5 and dv 3 the scalar one.
    for (batch, sq, hq, hkv, d, dv) in [(3, 5, 4, 2, 16, 8), (2, 3, 3, 1, 5, 3)] {
        let dims = AttnDims {
            batch,
            sq,
            sk: sq,
            hq,
            hkv,
            d,
            dv,
        };
        let (qw, kw, vw) = (hq * d, hkv * d, hkv * dv);
        let width = qw + kw + vw;
        let x = round_bf16(&rng.vec(batch * sq * width));
        let (mut q, mut k, mut v) = (
            vec![0.0; batch * sq * qw],
            vec![0.0; batch * sq * kw],
            vec![0.0; batch * sq * vw],
        );
        for si in 0..sq {
            for bi in 0..batch {
                let row = &x[(si * batch + bi) * width..][..width];
                let t = bi * sq + si;
                q[t * qw..][..qw].copy_from_slice(&row[..qw]);
                k[t * kw..][..kw].copy_from_slice(&row[qw..qw + kw]);
                v[t * vw..][..vw].copy_from_slice(&row[qw + kw..]);
            }
        }
        let (mut gq, mut gk, mut gv) = (
            dev.b(&vec![9.0; q.len()]),
            dev.b(&vec![9.0; k.len()]),
            dev.b(&vec![9.0; v.len()]),
        );
        gpu.split_qkv(&dev.b(&x), &dims, &mut gq, &mut gk, &mut gv)
            .unwrap();
        assert_eq!(dev.gb(&gq), q, "split q d{d}");
        assert_eq!(dev.gb(&gk), k, "split k d{d}");
        assert_eq!(dev.gb(&gv), v, "split v d{d}");
        let mut gx = dev.b(&vec![9.0; x.len()]);
        gpu.join_qkv(&dev.b(&q), &dev.b(&k), &dev.b(&v), &dims, &mut gx)
            .unwrap();
        assert_eq!(dev.gb(&gx), x, "join d{d}");
    }

    // [b, s, w] <-> [s, b, w]: exact copies.
    for (b, s, w) in [(3, 7, 16), (2, 5, 3)] {
        let x = round_bf16(&rng.vec(b * s * w));
        let mut sbw = vec![0.0; x.len()];
        for bi in 0..b {
            for si in 0..s {
                sbw[(si * b + bi) * w..][..w].copy_from_slice(&x[(bi * s + si) * w..][..w]);
            }
        }
        let mut gy = dev.b(&vec![0.0; x.len()]);
        gpu.transpose_bs(&dev.b(&x), b, s, w, true, &mut gy)
            .unwrap();
        assert_eq!(dev.gb(&gy), sbw, "to [s, b, w], w {w}");
        let mut back = dev.b(&vec![0.0; x.len()]);
        gpu.transpose_bs(&gy, b, s, w, false, &mut back).unwrap();
        assert_eq!(dev.gb(&back), x, "to [b, s, w], w {w}");
    }

    // RoPE on fused rows: the CPU rope on the query and key parts, values copied.
    let (rows, hq, hkv, d, theta) = (11, 4, 2, 64, cpu::Rope::plain(500_000.0));
    let width = (hq + hkv) * d + hkv * 24;
    let x = round_bf16(&rng.vec(rows * width));
    let pos: Vec<u32> = (0..rows as u32).map(|r| r * 977 + 3).collect();
    for backward in [false, true] {
        let mut want = x.clone();
        for (start, heads) in [(0, hq), (hq * d, hkv)] {
            let part: Vec<f32> = (0..rows)
                .flat_map(|r| x[r * width + start..][..heads * d].to_vec())
                .collect();
            let mut out = vec![0.0; part.len()];
            if backward {
                cpu::rope_bwd(&part, &pos, rows, heads, d, theta, &mut out).unwrap();
            } else {
                cpu::rope_fwd(&part, &pos, rows, heads, d, theta, &mut out).unwrap();
            }
            for r in 0..rows {
                want[r * width + start..][..heads * d]
                    .copy_from_slice(&out[r * heads * d..][..heads * d]);
            }
        }
        let mut gy = dev.b(&vec![0.0; x.len()]);
        gpu.rope_qkv(
            &dev.b(&x),
            &dev.u(&pos),
            rows,
            hq,
            hkv,
            d,
            width,
            theta,
            backward,
            &mut gy,
        )
        .unwrap();
        close(
            &format!("rope_qkv backward={backward}"),
            &dev.gb(&gy),
            &want,
            1e-2,
            BF16_RTOL,
        );
    }
    // With no value columns the rows are rope_fwd's [tokens, heads, d]: the same
    // rotation, bit for bit.
    let width = (hq + hkv) * d;
    let x = round_bf16(&rng.vec(rows * width));
    let (gx, gpos) = (dev.b(&x), dev.u(&pos));
    let (mut fused, mut plain) = (dev.b(&vec![0.0; x.len()]), dev.b(&vec![0.0; x.len()]));
    gpu.rope_qkv(
        &gx, &gpos, rows, hq, hkv, d, width, theta, false, &mut fused,
    )
    .unwrap();
    gpu.rope_fwd(&gx, &gpos, rows, hq + hkv, d, theta, &mut plain)
        .unwrap();
    assert_eq!(dev.gb(&fused), dev.gb(&plain), "rope_qkv vs rope_fwd");

    // Bias add and gradient; 300 rows make several row chunks.
    for (rows, n) in [(37, 64), (300, 5), (1000, 129), (600, 256)] {
        let y0 = round_bf16(&rng.vec(rows * n));
        let bias = round_bf16(&rng.vec(n));
        let want: Vec<f32> = y0
            .iter()
            .enumerate()
            .map(|(i, &v)| v + bias[i % n])
            .collect();
        let mut gy = dev.b(&y0);
        gpu.bias_add(&mut gy, &dev.b(&bias), rows, n).unwrap();
        close("bias_add", &dev.gb(&gy), &want, 1e-6, BF16_RTOL);
        let db0 = rng.vec(n);
        let mut want = db0.clone();
        for r in 0..rows {
            for c in 0..n {
                want[c] += y0[r * n + c];
            }
        }
        let mut gdb = dev.f(&db0);
        gpu.bias_grad(&dev.b(&y0), rows, n, &mut gdb).unwrap();
        close("bias_grad", &dev.gf(&gdb), &want, 1e-4, 1e-4);
    }

    // acc += x; 1003: an aligned 8-wide body and a scalar tail.
    let n = 1003;
    let acc0 = round_bf16(&rng.vec(n));
    let x = round_bf16(&rng.vec(n));
    let want: Vec<f32> = acc0.iter().zip(&x).map(|(a, b)| a + b).collect();
    let mut gacc = dev.b(&acc0);
    gpu.accumulate(&mut gacc, &dev.b(&x)).unwrap();
    close("accumulate", &dev.gb(&gacc), &want, 1e-6, BF16_RTOL);
}

#[test]
fn gpu_rejects_bad_sizes_without_launching() {
    let Some(gpu) = gpu_or_skip("gpu_rejects_bad_sizes_without_launching") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let dims = AttnDims {
        batch: 1,
        sq: 2,
        sk: 2,
        hq: 3,
        hkv: 2,
        d: 4,
        dv: 4,
    };
    let e = gpu.attention_fwd(
        &dims,
        &dev.b(&[0.0; 24]),
        &dev.b(&[0.0; 16]),
        &dev.b(&[0.0; 16]),
        0,
        0,
        true,
        1.0,
        None,
        &mut dev.b(&[0.0; 24]),
        &mut dev.f(&[0.0; 6]),
    );
    assert!(matches!(e, Err(GpuError::Args(_))), "{e:?}");
    let e = gpu.rope_fwd(
        &dev.b(&[0.0; 3]),
        &dev.u(&[0]),
        1,
        1,
        3,
        cpu::Rope::plain(1e4),
        &mut dev.b(&[0.0; 3]),
    );
    assert!(matches!(e, Err(GpuError::Args(_))));
    // Query and key columns wider than the row.
    let e = gpu.rope_qkv(
        &dev.b(&[0.0; 8]),
        &dev.u(&[0]),
        1,
        2,
        1,
        4,
        8,
        cpu::Rope::plain(1e4),
        false,
        &mut dev.b(&[0.0; 8]),
    );
    assert!(matches!(e, Err(GpuError::Args(_))), "{e:?}");
    let (mut q, mut k, mut v) = (dev.b(&[0.0; 24]), dev.b(&[0.0; 15]), dev.b(&[0.0; 16]));
    let e = gpu.split_qkv(&dev.b(&[0.0; 56]), &dims, &mut q, &mut k, &mut v);
    assert!(matches!(e, Err(GpuError::Args(_))), "{e:?}");
}

#[test]
fn gpu_gemm_at_and_gather_rows_match_cpu() {
    let Some(gpu) = gpu_or_skip("gpu_gemm_at_and_gather_rows_match_cpu") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let mut rng = Rng::new(501);
    // Three experts' rows (5, 0 and 3 of them) against their blocks of a stacked
    // [3, 16, 24] weight, forward and both backward products.
    let (h, u, counts) = (16, 24, [5usize, 0, 3]);
    let total: usize = counts.iter().sum();
    let x = round_bf16(&rng.vec(total * h));
    let w = round_bf16(&rng.vec(3 * h * u));
    let dy = round_bf16(&rng.vec(total * u));
    let (gx, gw, gdy) = (dev.b(&x), dev.b(&w), dev.b(&dy));
    let mut y = vec![0.0; total * u];
    let mut gy = dev.b(&vec![0.0; total * u]);
    let mut dw = vec![0.5; 3 * h * u];
    let mut gdw = dev.f(&dw);
    let mut off = 0;
    for (j, &n) in counts.iter().enumerate() {
        let fwd = cpu::GemmAt {
            ta: Transpose::No,
            tb: Transpose::No,
            m: n,
            k: h,
            n: u,
            a_off: off * h,
            b_off: j * h * u,
            c_off: off * u,
        };
        cpu::matmul_at(&fwd, &x, &w, 0.0, &mut y).unwrap();
        gpu.gemm_at(&fwd, &gx, &gw, 0.0, &mut gy).unwrap();
        let wgrad = cpu::GemmAt {
            ta: Transpose::Yes,
            tb: Transpose::No,
            m: h,
            k: n,
            n: u,
            a_off: off * h,
            b_off: off * u,
            c_off: j * h * u,
        };
        cpu::matmul_at(&wgrad, &x, &dy, 1.0, &mut dw).unwrap();
        gpu.gemm_at(&wgrad, &gx, &gdy, 1.0, &mut gdw).unwrap();
        off += n;
    }
    close("gemm_at y", &dev.gb(&gy), &y, 1e-2, BF16_RTOL);
    close("gemm_at dw", &dev.gf(&gdw), &dw, 1e-4, 1e-4);
    // A span past the buffer is refused before launch.
    let past = cpu::GemmAt {
        ta: Transpose::No,
        tb: Transpose::No,
        m: 2,
        k: h,
        n: u,
        a_off: (total - 1) * h,
        b_off: 0,
        c_off: 0,
    };
    assert!(matches!(
        gpu.gemm_at(&past, &gx, &gw, 0.0, &mut gy),
        Err(GpuError::Args(_))
    ));
    // Rows moved exactly, zeros for NO_ROW.
    let idx = [7u32, cpu::NO_ROW, 0, 3, 3];
    let mut out = vec![0.0; idx.len() * h];
    cpu::gather_rows(&x, &idx, h, &mut out).unwrap();
    let mut gout = dev.b(&vec![1.0; idx.len() * h]);
    gpu.gather_rows(&gx, &dev.u(&idx), h, &mut gout).unwrap();
    assert_eq!(dev.gb(&gout), out);
}

#[test]
fn gpu_first_non_finite_names_the_first_tensor() {
    let Some(gpu) = gpu_or_skip("gpu_first_non_finite_names_the_first_tensor") else {
        return;
    };
    let dev = Dev { gpu: &gpu };
    let ok = dev.f(&vec![1.0; 5000]);
    let mut bad = vec![0.5; 7000];
    bad[6999] = f32::INFINITY;
    let (b1, b2) = (dev.f(&bad), dev.f(&[f32::NAN]));
    assert_eq!(gpu.first_non_finite(&[&ok, &ok]).unwrap(), None);
    assert_eq!(gpu.first_non_finite(&[&ok, &b2, &b1]).unwrap(), Some(1));
    assert_eq!(gpu.first_non_finite(&[&b1, &b2]).unwrap(), Some(0));
}
