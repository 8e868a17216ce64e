//! `calibrate`: measure this node's GPUs into a calibration overlay. The sweep and the
//! fits are `meshplan_cost_model::calibrate`; the timing needs the CUDA backend.

use crate::run::{bad, runtime};
use crate::Failure;
use meshplan_cost_model::calibrate::MeasurementPlan;
use std::path::Path;

/// GPUs per node the dry run describes (the real run uses the GPUs it finds).
const DRY_RUN_GPUS: u64 = 8;

/// `meshplan calibrate`.
pub(crate) fn calibrate(
    output: Option<&Path>,
    backend: &str,
    dry_run: bool,
) -> Result<(), Failure> {
    match backend {
        "cuda" => {}
        "cpu" => {
            return Err(bad(
                "calibrate measures GPUs; --backend cpu has none to measure: run `meshplan calibrate --backend cuda` on a node of the cluster".into(),
            ))
        }
        other => return Err(bad(format!("--backend {other}: expected cuda"))),
    }
    let plan = MeasurementPlan::standard(DRY_RUN_GPUS);
    if dry_run {
        println!(
            "meshplan calibrate measures, on a node of {DRY_RUN_GPUS} GPUs (the run uses the GPUs it finds):"
        );
        print!("{}", plan.describe());
        match output {
            Some(o) => println!("and writes the fits to {}", o.display()),
            None => println!("and writes the fits to the FILE given with -o FILE"),
        }
        return Ok(());
    }
    // clap already requires -o without --dry-run; this keeps a caller honest.
    let Some(output) = output else {
        return Err(bad(
            "calibrate: -o FILE is needed to write the overlay (only --dry-run runs without it)"
                .into(),
        ));
    };
    measure(output)
}

#[cfg(not(feature = "cuda"))]
fn measure(output: &Path) -> Result<(), Failure> {
    Err(runtime(format!(
        "calibrate: this binary has no CUDA backend (rebuild with `cargo build --release --features cuda`), so nothing was measured and {} was not written; `meshplan calibrate --dry-run` lists what it will measure",
        output.display()
    )))
}

#[cfg(feature = "cuda")]
fn measure(output: &Path) -> Result<(), Failure> {
    let m = cuda::measure().map_err(|e| {
        runtime(format!(
            "calibrate: no CUDA backend can measure here: {e}; nothing was written to {}",
            output.display()
        ))
    })?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let overlay = meshplan_cost_model::calibrate::build_overlay(&m, &rfc3339_utc(now))
        .map_err(|e| runtime(format!("calibrate: fitting the measurements: {e}")))?;
    let yaml = overlay.to_yaml();
    crate::atomic::write_atomically(output, yaml.as_bytes(), "overlay")?;
    println!("wrote {}", output.display());
    Ok(())
}

#[cfg(feature = "cuda")]
use meshplan_cost_model::calibrate::rfc3339_utc;

/// The timing itself: cuBLASLt GEMMs, device copies and flash attention on device 0
/// (CUDA events on the `Gpu`'s stream), NCCL sweeps over the process's GPUs.
#[cfg(feature = "cuda")]
mod cuda {
    use meshplan_cost_model::calibrate::{
        AttentionSample, CollectiveSample, GemmSample, MeasurementPlan, Measurements, SizeSample,
    };
    use meshplan_cost_model::overlay::LinkOp;
    use meshplan_executor::comm::{nccl_available, BenchOp, NcclBench};
    use meshplan_executor::kernels::cpu::{AttnDims, Transpose};
    use meshplan_executor::kernels::cuda::cudarc::driver::sys::CUevent_flags;
    use meshplan_executor::kernels::cuda::{bf16, Gpu};
    use meshplan_ir::DType;

    type R<T> = Result<T, String>;

    fn e<E: std::fmt::Debug>(what: &'static str) -> impl Fn(E) -> String {
        move |x| format!("{what}: {x:?}")
    }

    /// Median seconds of `f` over `repeats` runs after `warmup`, timed with CUDA
    /// events on the `Gpu`'s stream.
    fn time(gpu: &Gpu, warmup: u32, repeats: u32, mut f: impl FnMut() -> R<()>) -> R<f64> {
        for _ in 0..warmup {
            f()?;
        }
        let s = gpu.stream();
        let mut ts = Vec::new();
        for _ in 0..repeats.max(1) {
            let a = s
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(e("event"))?;
            f()?;
            let b = s
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(e("event"))?;
            b.synchronize().map_err(e("event sync"))?;
            ts.push(f64::from(a.elapsed_ms(&b).map_err(e("event time"))?) / 1e3);
        }
        ts.sort_by(f64::total_cmp);
        Ok(ts[ts.len() / 2])
    }

    fn bench_op(op: LinkOp) -> BenchOp {
        match op {
            LinkOp::AllReduce => BenchOp::AllReduce,
            LinkOp::AllGather => BenchOp::AllGather,
            LinkOp::ReduceScatter => BenchOp::ReduceScatter,
            LinkOp::Broadcast => BenchOp::Broadcast,
            LinkOp::AllToAll => BenchOp::AllToAll,
            LinkOp::SendRecv => BenchOp::SendRecv,
        }
    }

    pub(super) fn measure() -> R<Measurements> {
        let gpu = Gpu::new().map_err(|x| x.to_string())?;
        let info = gpu.info().clone();
        println!("calibrating on {info}");
        let mut plan = MeasurementPlan::standard(info.device_count as u64);
        if std::env::var("MESHPLAN_CALIBRATE_QUICK").is_ok_and(|v| v == "1") {
            // scripts/gpu-check.sh: the same sweep, fewer repeats.
            plan.warmup = 2;
            plan.repeats = 5;
        }
        let (w, r) = (plan.warmup, plan.repeats);
        gpu.load_all().map_err(|x| x.to_string())?;
        let mut m = Measurements {
            device: info.name.clone(),
            gpus_per_node: info.device_count as u64,
            measured_with: format!(
                "meshplan calibrate {} (cuBLASLt bf16, CUDA events)",
                env!("CARGO_PKG_VERSION")
            ),
            gemm: Vec::new(),
            hbm: Vec::new(),
            attention: Vec::new(),
            collectives: Vec::new(),
        };

        println!("\nGEMM (bf16 in, fp32 accumulate, bf16 out; cuBLASLt; the fp16/fp32 rows of the plan are not measured)");
        println!(
            "{:>7} {:>7} {:>7} {:>12} {:>10}",
            "m", "n", "k", "median ms", "TFLOP/s"
        );
        for &(mm, nn, kk) in &plan.gemm_shapes {
            let (mu, nu, ku) = (mm as usize, nn as usize, kk as usize);
            let a = gpu.zeros::<bf16>(mu * ku).map_err(|x| x.to_string())?;
            let b = gpu.zeros::<bf16>(ku * nu).map_err(|x| x.to_string())?;
            let mut c = gpu.zeros::<bf16>(mu * nu).map_err(|x| x.to_string())?;
            let t = time(&gpu, w, r, || {
                gpu.gemm(
                    Transpose::No,
                    Transpose::No,
                    mu,
                    ku,
                    nu,
                    &a,
                    &b,
                    0.0,
                    &mut c,
                )
                .map_err(|x| x.to_string())
            })?;
            let tf = 2.0 * (mm * nn * kk) as f64 / t / 1e12;
            println!("{mm:>7} {nn:>7} {kk:>7} {:>12.4} {tf:>10.1}", t * 1e3);
            m.gemm.push(GemmSample {
                dtype: DType::Bf16,
                m: mm,
                n: nn,
                k: kk,
                seconds: t,
            });
        }

        println!("\nHBM (device-to-device copy; bytes read + written)");
        println!("{:>12} {:>12} {:>10}", "copy MiB", "median ms", "GB/s");
        for &bytes in &plan.hbm_copy_bytes {
            let src = gpu.zeros::<u8>(bytes as usize).map_err(|x| x.to_string())?;
            let mut dst = gpu.zeros::<u8>(bytes as usize).map_err(|x| x.to_string())?;
            let t = time(&gpu, w, r, || {
                gpu.stream()
                    .memcpy_dtod(&src, &mut dst)
                    .map_err(e("memcpy_dtod"))
            })?;
            let moved = 2.0 * bytes as f64;
            println!(
                "{:>12} {:>12.4} {:>10.1}",
                bytes >> 20,
                t * 1e3,
                moved / t / 1e9
            );
            m.hbm.push(SizeSample {
                bytes: moved,
                seconds: t,
            });
        }

        println!("\nflash attention (bf16, causal; TFLOP/s as the cost model counts, backward = 2.5x forward FLOPs)");
        println!(
            "{:>6} {:>6} {:>6} {:>6} {:>10} {:>10}",
            "batch", "heads", "seq", "d", "fwd TF/s", "bwd TF/s"
        );
        for case in &plan.attention {
            let dims = AttnDims {
                batch: case.batch as usize,
                sq: case.seq as usize,
                sk: case.seq as usize,
                hq: case.heads as usize,
                hkv: case.heads as usize,
                d: case.head_dim as usize,
                dv: case.head_dim as usize,
            };
            let n = dims.batch * dims.sq * dims.hq * dims.d;
            let rows = dims.batch * dims.sq * dims.hq;
            let z = |n: usize| gpu.zeros::<bf16>(n).map_err(|x| x.to_string());
            let (q, k, v, d_o) = (z(n)?, z(n)?, z(n)?, z(n)?);
            let (mut o, mut dq, mut dk, mut dv) = (z(n)?, z(n)?, z(n)?, z(n)?);
            let mut lse = gpu.zeros::<f32>(rows).map_err(|x| x.to_string())?;
            let scale = 1.0 / (case.head_dim as f32).sqrt();
            let fwd = time(&gpu, w, r, || {
                gpu.attention_fwd(
                    &dims,
                    &q,
                    &k,
                    &v,
                    0,
                    0,
                    case.causal,
                    scale,
                    &mut o,
                    &mut lse,
                )
                .map_err(|x| x.to_string())
            })?;
            let bwd = time(&gpu, w, r, || {
                gpu.attention_bwd(
                    &dims,
                    &q,
                    &k,
                    &v,
                    &o,
                    &lse,
                    &d_o,
                    0,
                    0,
                    case.causal,
                    scale,
                    &mut dq,
                    &mut dk,
                    &mut dv,
                )
                .map_err(|x| x.to_string())
            })?;
            let f = case.forward_flops();
            println!(
                "{:>6} {:>6} {:>6} {:>6} {:>10.1} {:>10.1}",
                case.batch,
                case.heads,
                case.seq,
                case.head_dim,
                f / fwd / 1e12,
                2.5 * f / bwd / 1e12
            );
            m.attention.push(AttentionSample {
                dtype: DType::Bf16,
                case: *case,
                forward_s: fwd,
                backward_s: bwd,
            });
        }

        if info.device_count < 2 {
            println!("\ncollectives: 1 GPU in this process, nothing to measure");
        } else if let Err(x) = nccl_available() {
            println!("\ncollectives: not measured: {x}");
        } else {
            println!(
                "\nNCCL (fp32 buffers; bus bandwidth not applied: algorithm GB/s = bytes / time)"
            );
            let mut benches: Vec<(u64, NcclBench)> = Vec::new();
            for sweep in &plan.collectives {
                if !benches.iter().any(|(n, _)| *n == sweep.ranks) {
                    let devices: Vec<usize> = (0..sweep.ranks as usize).collect();
                    benches.push((
                        sweep.ranks,
                        NcclBench::new(&devices).map_err(|x| x.to_string())?,
                    ));
                }
                let bench = &benches
                    .iter()
                    .find(|(n, _)| *n == sweep.ranks)
                    .ok_or("bench")?
                    .1;
                for &bytes in &sweep.bytes {
                    let t = bench
                        .time(bench_op(sweep.op), bytes, w, r)
                        .map_err(|x| x.to_string())?;
                    m.collectives.push(CollectiveSample {
                        op: sweep.op,
                        ranks: sweep.ranks,
                        sample: SizeSample {
                            bytes: bytes as f64,
                            seconds: t,
                        },
                    });
                }
                let last = m.collectives.last().map(|c| c.sample).ok_or("no sample")?;
                println!(
                    "{:>15} over {} GPUs: 1 GiB in {:.3} ms = {:.1} GB/s",
                    sweep.op.name(),
                    sweep.ranks,
                    last.seconds * 1e3,
                    last.bytes / last.seconds / 1e9
                );
            }
        }
        Ok(m)
    }
}
