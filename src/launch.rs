//! `launch` (start this node's ranks as processes) and the hidden `rendezvous-check`
//! (every launched process joins the rendezvous, shares a 128-byte id as NCCL's
//! unique id will be shared, and rank 0 prints the rank -> node map).

use crate::run::{bad, runtime};
use crate::Failure;
use meshplan_launch::auth::TOKEN_VAR;
use meshplan_launch::env::DEFAULT_MASTER_PORT;
use meshplan_launch::rendezvous::fnv1a64;
use meshplan_launch::{
    hostname, launch as start, JobSecret, LaunchEnv, LaunchOptions, Rendezvous, RendezvousConfig,
    RendezvousError, SecretSource,
};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The flags of `launch`.
pub(crate) struct LaunchArgs {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: Option<String>,
    pub master_port: u16,
    pub grace_s: f64,
    pub command: Vec<OsString>,
}

/// `meshplan launch`.
pub(crate) fn launch(a: LaunchArgs) -> Result<(), Failure> {
    let mut command = a.command;
    // `-- meshplan run ...` (torchrun's habit of naming the program) means `-- run ...`.
    if command
        .first()
        .and_then(|c| Path::new(c).file_name())
        .is_some_and(|n| n == "meshplan")
    {
        command.remove(0);
    }
    match command.first().and_then(|c| c.to_str()) {
        None => {
            return Err(bad(
                "launch: give the meshplan command each rank runs after `--`, e.g. `meshplan launch --nproc-per-node 8 -- run plan.json --backend cuda`".into(),
            ))
        }
        Some("launch") => return Err(bad("launch: the ranks cannot launch again".into())),
        Some(_) => {}
    }
    if !(a.grace_s.is_finite() && a.grace_s >= 0.0) {
        return Err(bad(format!("--grace {}: expected seconds >= 0", a.grace_s)));
    }
    let master_addr = match (a.master_addr, a.nnodes) {
        (Some(addr), _) => addr,
        (None, 1) => "127.0.0.1".to_string(),
        (None, n) => {
            return Err(bad(format!(
                "--nnodes {n}: give --master-addr, the host of node 0 (where rank 0 listens), the same on every node"
            )))
        }
    };
    let master_port = if a.master_port == 0 {
        if a.nnodes > 1 {
            return Err(bad(format!(
                "--master-port 0 picks a free port on this node only; with --nnodes {} give every node the same port (e.g. {DEFAULT_MASTER_PORT})",
                a.nnodes
            )));
        }
        free_port(&master_addr)?
    } else {
        a.master_port
    };
    let job_token = job_token(a.nnodes)?;
    let program = std::env::current_exe()
        .map_err(|e| runtime(format!("launch: cannot find this program: {e}")))?;
    let opts = LaunchOptions {
        program,
        args: command,
        nproc_per_node: a.nproc_per_node,
        nnodes: a.nnodes,
        node_rank: a.node_rank,
        master_addr,
        master_port,
        grace: Duration::from_secs_f64(a.grace_s),
        job_token,
    };
    meshplan_launch::check_options(&opts).map_err(bad)?;
    tracing::info!(
        "launching ranks {}..{} of {} (MASTER_ADDR={} MASTER_PORT={})",
        a.node_rank * a.nproc_per_node,
        (a.node_rank + 1) * a.nproc_per_node - 1,
        a.nnodes * a.nproc_per_node,
        opts.master_addr,
        opts.master_port
    );
    // The flags were checked above: what fails now (a rank that cannot start, the
    // signals) is the machine's.
    let outcome = start(&opts).map_err(runtime)?;
    match (outcome.first_failure, outcome.signal) {
        (Some((rank, code)), _) => Err(Failure {
            code: clamp_code(code),
            message: format!("rank {rank} exited with code {code}; stopped the other ranks"),
        }),
        (None, Some(sig)) => Err(Failure {
            code: clamp_code(outcome.exit_code),
            message: format!("stopped by signal {sig}, forwarded to every rank"),
        }),
        (None, None) => Ok(()),
    }
}

/// The `MESHPLAN_JOB_TOKEN` to hand the ranks: none when the launcher has one (they
/// inherit it; checked here so that a bad one fails once, not once per rank), a fresh
/// random one on a single node. On several nodes each node's launcher would make a
/// different one, so there the ranks fall back (see `JobSecret::from_env`) and the
/// launcher says how to set one.
fn job_token(nnodes: usize) -> Result<Option<String>, Failure> {
    let own = JobSecret::from_env().map_err(|e| bad(format!("launch: {e}")))?;
    match own.source() {
        SecretSource::Token => Ok(None),
        _ if nnodes == 1 => JobSecret::generate_token()
            .map(Some)
            .map_err(|e| runtime(format!("launch: {e}"))),
        source => {
            let fallback = match source {
                SecretSource::SlurmJob(id) => format!("a key derived from SLURM_JOB_ID={id}"),
                _ => "no secret at all".to_string(),
            };
            tracing::warn!(
                "--nnodes {nnodes} without {TOKEN_VAR}: the launchers of different nodes cannot agree on a random one, so the ranks use {fallback}; export the same {TOKEN_VAR} (e.g. $(openssl rand -hex 32)) on every node before `meshplan launch`"
            );
            Ok(None)
        }
    }
}

fn clamp_code(code: i32) -> u8 {
    u8::try_from(code).ok().filter(|&c| c != 0).unwrap_or(1)
}

/// A port free on `addr` now (single-node launches with `--master-port 0`).
fn free_port(addr: &str) -> Result<u16, Failure> {
    let l = std::net::TcpListener::bind((addr, 0))
        .or_else(|_| std::net::TcpListener::bind(("127.0.0.1", 0)))
        .map_err(|e| runtime(format!("--master-port 0: cannot find a free port: {e}")))?;
    let port = l
        .local_addr()
        .map_err(|e| runtime(format!("--master-port 0: {e}")))?
        .port();
    Ok(port)
}

/// The flags of `rendezvous-check`.
pub(crate) struct CheckArgs {
    pub timeout_s: f64,
    pub plan: Option<PathBuf>,
    pub fail_rank: Option<usize>,
    pub fail_code: u8,
    pub hold_s: f64,
}

fn rendezvous_failure(e: RendezvousError) -> Failure {
    Failure {
        code: if e.is_bad_input() { 2 } else { 1 },
        message: e.to_string(),
    }
}

/// `meshplan rendezvous-check` (hidden; tests and first-time setups).
pub(crate) fn rendezvous_check(a: &CheckArgs) -> Result<(), Failure> {
    let env = LaunchEnv::from_env()
        .map_err(|e| bad(format!("launch variables: {e}")))?
        .unwrap_or_else(|| LaunchEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: Some(1),
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            sources: meshplan_launch::env::Sources {
                rank: "default",
                world_size: "default",
                local_rank: "default",
                master_addr: "default",
                master_port: "default",
            },
        });
    if !(a.timeout_s.is_finite() && a.timeout_s > 0.0) {
        return Err(bad(format!(
            "--timeout {}: expected seconds > 0",
            a.timeout_s
        )));
    }
    if a.fail_rank == Some(env.rank) {
        return Err(Failure {
            code: a.fail_code,
            message: format!("rank {} fails on purpose (--fail-rank)", env.rank),
        });
    }
    let plan_hash = match &a.plan {
        Some(p) => fnv1a64(
            &meshplan_ir::input::read_bounded(p, meshplan_ir::input::PLAN_LIMIT)
                .map_err(|e| bad(format!("{}: cannot read: {e}", p.display())))?,
        ),
        None => 0,
    };
    let secret = JobSecret::from_env().map_err(|e| bad(format!("launch variables: {e}")))?;
    let host = hostname();
    println!(
        "rank {} of {}: host {host}, local rank {}, pid {}",
        env.rank,
        env.world_size,
        env.local_rank,
        std::process::id()
    );
    // The job id, never the token: tests and operators check that ranks agree.
    println!(
        "rank {}: job {} (key from {})",
        env.rank,
        secret.job_id_hex(),
        match secret.source() {
            SecretSource::Token => TOKEN_VAR.to_string(),
            SecretSource::SlurmJob(id) => format!("SLURM_JOB_ID={id}"),
            SecretSource::Open => "nothing: open".to_string(),
        }
    );
    let cfg = RendezvousConfig {
        master_addr: env.master_addr.clone(),
        master_port: env.master_port,
        rank: env.rank,
        world_size: env.world_size,
        plan_hash,
        timeout: Duration::from_secs_f64(a.timeout_s),
    };
    let mut rv = Rendezvous::connect_with(&cfg, &secret).map_err(rendezvous_failure)?;
    let mine = format!(
        "{host}\t{}\t{}\t{}",
        env.local_rank,
        std::process::id(),
        env.local_world_size
            .map_or("-".to_string(), |v| v.to_string())
    );
    let all = rv
        .all_gather_bytes(mine.as_bytes())
        .map_err(rendezvous_failure)?;
    // The NCCL unique id's path: 128 bytes made by rank 0, the same on every rank.
    let id = if env.rank == 0 {
        unique_id()
    } else {
        Vec::new()
    };
    let id = rv.broadcast(&id).map_err(rendezvous_failure)?;
    let digest = fnv1a64(&id);
    let digests = rv
        .all_gather_bytes(&digest.to_le_bytes())
        .map_err(rendezvous_failure)?;
    println!(
        "rank {}: joined {}:{}; id of {} bytes, fnv1a64 {digest:016x}",
        env.rank,
        env.master_addr,
        env.master_port,
        id.len()
    );
    if env.rank == 0 {
        report_map(&all, &digests, env.world_size)?;
    }
    if a.hold_s > 0.0 {
        std::thread::sleep(Duration::from_secs_f64(a.hold_s));
    }
    rv.barrier().map_err(rendezvous_failure)?;
    if env.rank == 0 {
        println!("rendezvous ok: {} ranks", env.world_size);
    }
    Ok(())
}

/// 128 bytes that differ between runs (a stand-in for `ncclGetUniqueId`).
fn unique_id() -> Vec<u8> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut s = nanos ^ (u64::from(std::process::id()) << 32);
    (0..16)
        .flat_map(|_| {
            // splitmix64
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)).to_le_bytes()
        })
        .collect()
}

/// Rank 0's report: the rank -> node map, and the checks that every node's local
/// ranks are distinct and as many as it says, and that every rank got the same id.
fn report_map(all: &[Vec<u8>], digests: &[Vec<u8>], world: usize) -> Result<(), Failure> {
    let mut nodes: BTreeMap<String, Vec<(usize, usize, String)>> = BTreeMap::new();
    println!("rank -> node map (WORLD_SIZE={world}):");
    for (rank, b) in all.iter().enumerate() {
        let text = String::from_utf8_lossy(b);
        let f: Vec<&str> = text.split('\t').collect();
        let [host, local, pid, local_world] = f[..] else {
            return Err(runtime(format!(
                "rank {rank} sent a malformed entry `{text}`"
            )));
        };
        let local: usize = local.parse().unwrap_or(usize::MAX);
        println!("  rank {rank}: host {host}, local rank {local}, pid {pid}");
        nodes
            .entry(host.to_string())
            .or_default()
            .push((rank, local, local_world.to_string()));
    }
    for (host, ranks) in &nodes {
        let list: Vec<String> = ranks.iter().map(|r| r.0.to_string()).collect();
        println!("node {host}: ranks {}", list.join(","));
        let mut seen: BTreeMap<usize, usize> = BTreeMap::new();
        for &(rank, local, ref lw) in ranks {
            if let Some(other) = seen.insert(local, rank) {
                return Err(bad(format!(
                    "ranks {other} and {rank} both have LOCAL_RANK={local} on host {host}: give each process of a node its own LOCAL_RANK (its GPU)"
                )));
            }
            if let Ok(lw) = lw.parse::<usize>() {
                if lw != ranks.len() {
                    return Err(bad(format!(
                        "rank {rank} says LOCAL_WORLD_SIZE={lw}, but host {host} runs {} ranks of this run",
                        ranks.len()
                    )));
                }
            }
        }
    }
    if digests.windows(2).any(|w| w[0] != w[1]) {
        return Err(runtime("the broadcast id differs between ranks".into()));
    }
    println!(
        "every rank holds the same {}-byte id; {} node(s)",
        128,
        nodes.len()
    );
    Ok(())
}
