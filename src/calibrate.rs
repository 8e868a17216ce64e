//! `calibrate`: measure this node's GPUs into a calibration overlay, and under a
//! launch on several nodes the collectives across them. The sweep and the fits are
//! `meshplan_cost_model::calibrate`; the timing needs the CUDA backend.

use crate::run::{bad, runtime};
use crate::Failure;
use meshplan_cost_model::calibrate::MeasurementPlan;
use meshplan_launch::LaunchEnv;
use std::path::Path;

/// GPUs per node the dry run describes (the real run uses the GPUs it finds).
const DRY_RUN_GPUS: u64 = 8;

/// `meshplan calibrate`.
pub(crate) fn calibrate(
    output: Option<&Path>,
    backend: &str,
    dry_run: bool,
    nodes: Option<u64>,
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
    if nodes == Some(0) {
        return Err(bad(
            "--nodes 0: a run spans at least 1 node; give the number of nodes the launch starts ranks on".into(),
        ));
    }
    if dry_run {
        let n = nodes.unwrap_or(1);
        let plan = MeasurementPlan::across_nodes(n, DRY_RUN_GPUS);
        if n >= 2 {
            println!(
                "meshplan calibrate measures, on {n} nodes of {DRY_RUN_GPUS} GPUs (the run uses the nodes and GPUs it is launched on; rank 0 times its node alone, then every rank joins the sweep across nodes):"
            );
        } else {
            println!(
                "meshplan calibrate measures, on a node of {DRY_RUN_GPUS} GPUs (the run uses the GPUs it finds):"
            );
        }
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
    let launched = LaunchEnv::from_env().map_err(|e| bad(format!("launch variables: {e}")))?;
    match launched.filter(|e| e.world_size > 1) {
        Some(env) => measure_launched(output, &env, nodes),
        None => match nodes.filter(|&n| n > 1) {
            Some(n) => Err(bad(format!(
                "--nodes {n}: measuring across nodes takes one process per GPU on every node; start it on each node as `meshplan launch --nproc-per-node GPUS --nnodes {n} --node-rank R --master-addr HOST --master-port PORT -- calibrate -o FILE` (or under torchrun or srun)"
            ))),
            None => measure(output),
        },
    }
}

#[cfg(not(feature = "cuda"))]
fn measure_launched(output: &Path, _: &LaunchEnv, _: Option<u64>) -> Result<(), Failure> {
    measure(output)
}

/// Waits of the rendezvous may last while rank 0 times its node alone (GEMMs, copies,
/// attention, every NCCL collective of the node: minutes) and while other ranks time
/// the groups they are not in.
#[cfg(feature = "cuda")]
const RENDEZVOUS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);

/// One process per GPU on every node: rank 0 times its node as a single-process run
/// does while the others wait, then every rank takes part in the sweep across nodes
/// (NCCL between the processes, each unique id through the TCP rendezvous), and rank 0
/// writes the overlay with both sections.
#[cfg(feature = "cuda")]
fn measure_launched(output: &Path, env: &LaunchEnv, nodes: Option<u64>) -> Result<(), Failure> {
    use meshplan_cost_model::calibrate::NodeLayout;
    use meshplan_launch::rendezvous::fnv1a64;
    use meshplan_launch::{hostname, Rendezvous, RendezvousConfig, RendezvousError};
    let rdv = |e: RendezvousError| Failure {
        code: if e.is_bad_input() { 2 } else { 1 },
        message: format!("calibrate: rendezvous: {e}"),
    };
    let cfg = RendezvousConfig {
        master_addr: env.master_addr.clone(),
        master_port: env.master_port,
        rank: env.rank,
        world_size: env.world_size,
        // Only calibrate ranks of this version join each other.
        plan_hash: fnv1a64(concat!("meshplan calibrate ", env!("CARGO_PKG_VERSION")).as_bytes()),
        timeout: RENDEZVOUS_TIMEOUT,
    };
    let mut rv = Rendezvous::connect(&cfg).map_err(rdv)?;
    let hosts: Vec<String> = rv
        .all_gather_bytes(hostname().as_bytes())
        .map_err(rdv)?
        .iter()
        .map(|h| String::from_utf8_lossy(h).into_owned())
        .collect();
    let layout = NodeLayout::of_hosts(&hosts).map_err(|e| bad(format!("calibrate: {e}")))?;
    if let Some(n) = nodes.filter(|&n| n != layout.nodes) {
        return Err(bad(format!(
            "calibrate: --nodes {n}, but the launch's {} ranks are on {} nodes; give --nodes {} or launch on {n} nodes",
            env.world_size, layout.nodes, layout.nodes
        )));
    }
    // Rank 0 alone: its node's GEMMs, copies, attention and collectives. Its outcome
    // goes to every rank, so a failure stops them all at once.
    let mut single = None;
    let mut status = Vec::new();
    if env.rank == 0 {
        match cuda::measure() {
            Ok(m) => single = Some(m),
            Err(e) => status = e.into_bytes(),
        }
    }
    let status = rv.broadcast(&status).map_err(rdv)?;
    if !status.is_empty() {
        return Err(runtime(format!(
            "calibrate: rank 0 could not measure its node: {}; nothing was written to {}",
            String::from_utf8_lossy(&status),
            output.display()
        )));
    }
    let across = cuda::across_nodes(env, &mut rv, &layout).map_err(|e| {
        runtime(format!(
            "calibrate: measuring across nodes on rank {}: {e}; nothing was written to {}",
            env.rank,
            output.display()
        ))
    })?;
    let Some(mut m) = single else {
        return Ok(());
    };
    m.inter_node = across;
    write_overlay(output, &m)
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
    write_overlay(output, &m)
}

#[cfg(feature = "cuda")]
fn write_overlay(
    output: &Path,
    m: &meshplan_cost_model::calibrate::Measurements,
) -> Result<(), Failure> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let overlay = meshplan_cost_model::calibrate::build_overlay(m, &rfc3339_utc(now))
        .map_err(|e| runtime(format!("calibrate: fitting the measurements: {e}")))?;
    let yaml = overlay.to_yaml();
    crate::atomic::write_atomically(output, yaml.as_bytes(), "overlay")?;
    println!("wrote {}", output.display());
    Ok(())
}

#[cfg(feature = "cuda")]
use meshplan_cost_model::calibrate::rfc3339_utc;

/// The timing itself: cuBLASLt GEMMs, device copies and flash attention on device 0
/// (CUDA events on the `Gpu`'s stream), NCCL sweeps over the process's GPUs, and
/// across nodes NCCL communicators between the launch's processes (cudarc's safe
/// `Comm`, one per group layout).
#[cfg(feature = "cuda")]
mod cuda {
    use meshplan_cost_model::calibrate::{
        AttentionSample, CollectiveSample, GemmSample, InterNodeSample, MeasurementPlan,
        Measurements, NodeLayout, SizeSample,
    };
    use meshplan_cost_model::overlay::LinkOp;
    use meshplan_executor::comm::{nccl_available, NcclBench};
    use meshplan_executor::kernels::cpu::{AttnDims, Transpose};
    use meshplan_executor::kernels::cuda::cudarc::driver::sys::CUevent_flags;
    use meshplan_executor::kernels::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use meshplan_executor::kernels::cuda::cudarc::nccl::{
        group_end, group_start, Comm, Id, ReduceOp,
    };
    use meshplan_executor::kernels::cuda::{bf16, Gpu};
    use meshplan_ir::DType;
    use meshplan_launch::{LaunchEnv, Rendezvous};
    use std::ffi::c_char;
    use std::sync::Arc;

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

    /// `plan` with fewer repeats under `MESHPLAN_CALIBRATE_QUICK=1`
    /// (scripts/gpu-check.sh: the same sweep, sooner).
    fn quick(mut plan: MeasurementPlan) -> MeasurementPlan {
        if std::env::var("MESHPLAN_CALIBRATE_QUICK").is_ok_and(|v| v == "1") {
            plan.warmup = 2;
            plan.repeats = 5;
        }
        plan
    }

    pub(super) fn measure() -> R<Measurements> {
        let gpu = Gpu::new().map_err(|x| x.to_string())?;
        let info = gpu.info().clone();
        println!("calibrating on {info}");
        let plan = quick(MeasurementPlan::standard(info.device_count as u64));
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
            inter_node: Vec::new(),
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
                    None,
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
                    None,
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
                        .time(sweep.op, bytes, w, r)
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

    /// One process's place in the groups of one layout of the sweep.
    struct Member {
        comm: Comm,
        /// Index in the group.
        index: usize,
        /// Ranks in the group.
        size: usize,
    }

    /// The sweep across the nodes of `layout`, every rank of the launch taking part;
    /// rank 0's samples (it is the first member of every first group) come back, the
    /// other ranks' vectors stay empty.
    pub(super) fn across_nodes(
        env: &LaunchEnv,
        rv: &mut Rendezvous,
        layout: &NodeLayout,
    ) -> R<Vec<InterNodeSample>> {
        let plan = quick(MeasurementPlan::across_nodes(layout.nodes, layout.per_node));
        if plan.inter_node.is_empty() {
            return Ok(Vec::new());
        }
        nccl_available().map_err(|x| x.to_string())?;
        let ctx = CudaContext::new(env.local_rank).map_err(e("CUDA device LOCAL_RANK"))?;
        let stream = ctx.new_stream().map_err(e("stream"))?;
        let me = *layout
            .places
            .get(env.rank)
            .ok_or("rank outside the layout")?;
        let report = env.rank == 0;
        if report {
            println!(
                "\nNCCL across {} nodes of {} ranks (fp32 buffers; algorithm GB/s = bytes / time)",
                layout.nodes, layout.per_node
            );
        }
        // Communicators per group layout, made once and kept to the end (the sends
        // pair ranks differently from the collectives of the same shape).
        let mut comms: Vec<((bool, u64, u64), Option<Member>)> = Vec::new();
        let mut out = Vec::new();
        for sweep in &plan.inter_node {
            let key = (
                sweep.op == LinkOp::SendRecv,
                sweep.nodes,
                sweep.ranks_per_node,
            );
            if !comms.iter().any(|(k, _)| *k == key) {
                let member = join(rv, layout, &sweep.groups(layout.per_node), me, &stream)?;
                comms.push((key, member));
            }
            let Some(member) = comms
                .iter()
                .find(|(k, _)| *k == key)
                .and_then(|(_, m)| m.as_ref())
            else {
                continue;
            };
            for &bytes in &sweep.bytes {
                let (moved, t) = time_across(member, &stream, sweep.op, bytes, &plan)?;
                if report {
                    out.push(InterNodeSample {
                        op: sweep.op,
                        nodes: sweep.nodes,
                        ranks_per_node: sweep.ranks_per_node,
                        sample: SizeSample {
                            bytes: moved as f64,
                            seconds: t,
                        },
                    });
                }
            }
            if let Some(last) = out.last().filter(|_| report) {
                println!(
                    "{:>15} across {} nodes x {}: {} B in {:.3} ms = {:.1} GB/s",
                    sweep.op.name(),
                    sweep.nodes,
                    sweep.ranks_per_node,
                    last.sample.bytes,
                    last.sample.seconds * 1e3,
                    last.sample.bytes / last.sample.seconds / 1e9
                );
            }
        }
        // No rank tears its communicators down while a peer may still be moving its
        // last bytes.
        rv.barrier().map_err(|x| x.to_string())?;
        Ok(out)
    }

    /// Makes this layout's communicators: each group's first member makes a unique id,
    /// every rank of the launch hands its (or nothing) to all through the rendezvous,
    /// and the members of each group join it. `None` when this rank is in no group.
    fn join(
        rv: &mut Rendezvous,
        layout: &NodeLayout,
        groups: &[Vec<(u64, u64)>],
        me: (u64, u64),
        stream: &Arc<CudaStream>,
    ) -> R<Option<Member>> {
        let mine = groups.iter().find(|g| g.contains(&me));
        let id: Vec<u8> = match mine {
            Some(g) if g[0] == me => Id::new()
                .map_err(e("ncclGetUniqueId"))?
                .internal()
                .iter()
                .map(|&c| c as u8)
                .collect(),
            _ => Vec::new(),
        };
        let ids = rv.all_gather_bytes(&id).map_err(|x| x.to_string())?;
        let Some(group) = mine else {
            return Ok(None);
        };
        let leader = layout
            .rank_of(group[0])
            .ok_or("a group's leader is not a rank")?;
        let bytes: [u8; 128] = ids[leader].as_slice().try_into().map_err(|_| {
            format!(
                "rank {leader}'s NCCL id has {} bytes, expected 128",
                ids[leader].len()
            )
        })?;
        let index = group.iter().position(|&p| p == me).ok_or("not a member")?;
        let comm = Comm::from_rank(
            stream.clone(),
            index,
            group.len(),
            Id::uninit(bytes.map(|b| b as c_char)),
        )
        .map_err(e("ncclCommInitRank"))?;
        Ok(Some(Member {
            comm,
            index,
            size: group.len(),
        }))
    }

    /// Median seconds of `op` on `bytes` (the cost model's message size, rounded to
    /// whole fp32 elements, at least one per rank where the buffer is split), timed
    /// on the host around the enqueue and a stream synchronisation as `NcclBench`
    /// times, and the bytes actually moved.
    fn time_across(
        m: &Member,
        stream: &Arc<CudaStream>,
        op: LinkOp,
        bytes: u64,
        plan: &MeasurementPlan,
    ) -> R<(u64, f64)> {
        let n = m.size;
        let whole = ((bytes / 4) as usize).max(1);
        let elems = match op {
            LinkOp::AllGather | LinkOp::ReduceScatter | LinkOp::AllToAll => (whole / n).max(1) * n,
            _ => whole,
        };
        let part = elems / n;
        let a: CudaSlice<f32> = stream.alloc_zeros(elems).map_err(e("alloc"))?;
        let mut b: CudaSlice<f32> = stream.alloc_zeros(elems).map_err(e("alloc"))?;
        let c = &m.comm;
        let mut once = || -> R<()> {
            let nccl = e("NCCL");
            match op {
                LinkOp::AllReduce => c.all_reduce(&a, &mut b, &ReduceOp::Sum).map(drop),
                LinkOp::AllGather => c.all_gather(&a.slice(0..part), &mut b).map(drop),
                LinkOp::ReduceScatter => c
                    .reduce_scatter(&a, &mut b.slice_mut(0..part), &ReduceOp::Sum)
                    .map(drop),
                LinkOp::Broadcast => c.broadcast(Some(&a), &mut b, 0).map(drop),
                LinkOp::AllToAll => {
                    group_start().map_err(e("ncclGroupStart"))?;
                    let mut status = Ok(());
                    for j in 0..n {
                        let peer = j as i32;
                        status = status
                            .and_then(|()| c.send(&a.slice(j * part..(j + 1) * part), peer))
                            .and_then(|()| {
                                c.recv(&mut b.slice_mut(j * part..(j + 1) * part), peer)
                                    .map(drop)
                            });
                    }
                    // Always close the group, even after a failed enqueue.
                    let end = group_end().map(drop);
                    status.and(end)
                }
                LinkOp::SendRecv if m.index == 0 => c.send(&a, 1),
                LinkOp::SendRecv => c.recv(&mut b, 0).map(drop),
            }
            .map_err(nccl)?;
            stream.synchronize().map_err(e("stream sync"))
        };
        for _ in 0..plan.warmup {
            once()?;
        }
        let mut ts = Vec::new();
        for _ in 0..plan.repeats.max(1) {
            let t = std::time::Instant::now();
            once()?;
            ts.push(t.elapsed().as_secs_f64());
        }
        ts.sort_by(f64::total_cmp);
        Ok(((elems * 4) as u64, ts[ts.len() / 2]))
    }
}
