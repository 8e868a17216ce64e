//! Ranks as processes, end to end over the release binary on loopback:
//! `meshplan launch` starts N processes of `rendezvous-check`, which find each other
//! through the TCP rendezvous, share a 128-byte id (NCCL's unique id's path) and
//! print the rank -> node map; a missing rank times out naming it; a different
//! WORLD_SIZE is refused naming both values; the first failure's exit code is
//! forwarded and the other ranks are stopped; signals are forwarded; no rank
//! outlives its launcher; `run` refuses a multi-process launch on the CPU backend.
//! Issue 16: `launch` hands its ranks one job token; a stranger process of another
//! job, killer frames and 100 idle connections do not stop a job of real processes.

use crate::bin::{command, finish, meshplan, plan_file, temp_dir, Run};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN_VAR: &str = "MESHPLAN_JOB_TOKEN";

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// `meshplan ARGS` with launch variables for `rank` of `world` on `port`.
fn rank_process(args: &[&str], rank: usize, world: usize, port: u16) -> Child {
    rank_process_with(args, rank, world, port, None)
}

/// As [`rank_process`], with `token` as `MESHPLAN_JOB_TOKEN` (`None`: unset).
fn rank_process_with(
    args: &[&str],
    rank: usize,
    world: usize,
    port: u16,
    token: Option<&str>,
) -> Child {
    let mut cmd = command();
    match token {
        Some(t) => cmd.env(TOKEN_VAR, t),
        None => cmd.env_remove(TOKEN_VAR),
    };
    cmd.args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn meshplan")
}

fn wait(args: &[&str], c: Child) -> Run {
    finish(args, &c.wait_with_output().expect("wait"))
}

/// Whether `pid` has exited (gone, or a zombie nobody reaped yet).
fn dead(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

#[test]
fn launch_joins_1_2_and_4_processes_and_prints_the_rank_map() {
    for n in [1usize, 2, 4] {
        let np = n.to_string();
        let args = [
            "launch",
            "--nproc-per-node",
            np.as_str(),
            "--master-port",
            "0",
            "--",
            "rendezvous-check",
            "--timeout",
            "30",
        ];
        let run = meshplan(&args);
        run.expect_code(0);
        let out = &run.stdout;
        assert!(
            out.contains(&format!("[rank 0] rank -> node map (WORLD_SIZE={n}):")),
            "{out}"
        );
        assert!(
            out.contains(&format!("[rank 0] rendezvous ok: {n} ranks")),
            "{out}"
        );
        assert!(
            out.contains("[rank 0] every rank holds the same 128-byte id; 1 node(s)"),
            "{out}"
        );
        let mut digests = std::collections::BTreeSet::new();
        for r in 0..n {
            let joined = format!("[rank {r}] rank {r}: joined 127.0.0.1:");
            let line = out
                .lines()
                .find(|l| l.starts_with(&joined))
                .unwrap_or_else(|| panic!("no `{joined}` in:\n{out}"));
            digests.insert(line.rsplit(' ').next().unwrap_or_default().to_string());
            assert!(
                out.contains(&format!("[rank 0]   rank {r}: host ")),
                "rank {r} missing from the map:\n{out}"
            );
            assert!(out.contains(&format!("local rank {r}, pid ")), "{out}");
        }
        assert_eq!(digests.len(), 1, "every rank got the same id:\n{out}");
    }
}

#[test]
fn a_missing_process_times_out_naming_its_rank() {
    // WORLD_SIZE=3, but only ranks 0 and 1 are started.
    let port = free_port();
    let args = ["rendezvous-check", "--timeout", "3"];
    let t0 = Instant::now();
    let r0 = rank_process(&args, 0, 3, port);
    let r1 = rank_process(&args, 1, 3, port);
    let (r0, r1) = (wait(&args, r0), wait(&args, r1));
    assert!(t0.elapsed() < Duration::from_secs(20));
    r0.expect_code(1);
    assert!(
        r0.stderr
            .contains("timed out after 3.0 s waiting at 127.0.0.1:")
            && r0.stderr.contains("for rank 2 of WORLD_SIZE=3 to connect"),
        "{}",
        r0.stderr
    );
    r1.expect_code(1);
    assert!(
        r1.stderr.contains("rank 0 aborted: timed out"),
        "{}",
        r1.stderr
    );
    assert!(
        r1.stderr.contains("rank 2 of WORLD_SIZE=3"),
        "{}",
        r1.stderr
    );
}

#[test]
fn a_different_world_size_is_refused_naming_both_values() {
    // Both hold the job's token, so rank 0 knows the misconfigured rank is its own
    // and fails the job at once.
    let port = free_port();
    let args = ["rendezvous-check", "--timeout", "20"];
    let token = Some("issue-16-it-token-0123456789");
    let r0 = rank_process_with(&args, 0, 2, port, token);
    let r1 = rank_process_with(&args, 1, 3, port, token);
    let (r0, r1) = (wait(&args, r0), wait(&args, r1));
    let want = "rank 1 was started with WORLD_SIZE=3, but rank 0 with WORLD_SIZE=2";
    r0.expect_code(2);
    assert!(r0.stderr.contains(want), "{}", r0.stderr);
    r1.expect_code(2);
    assert!(r1.stderr.contains(want), "{}", r1.stderr);
}

#[test]
fn bad_launch_variables_exit_2_naming_the_variable() {
    let run = finish(
        &["rendezvous-check"],
        &command()
            .args(["rendezvous-check", "--timeout", "1"])
            .env("RANK", "4")
            .env("WORLD_SIZE", "4")
            .output()
            .expect("run"),
    );
    run.expect_code(2);
    assert!(
        run.stderr.contains("RANK=4 is not below WORLD_SIZE=4"),
        "{}",
        run.stderr
    );
}

#[test]
fn launch_forwards_the_first_failure_and_stops_the_other_ranks() {
    // Rank 2 exits 7 at once; the others wait in the rendezvous (60 s) until the
    // launcher stops them.
    let t0 = Instant::now();
    let run = meshplan(&[
        "launch",
        "--nproc-per-node",
        "4",
        "--master-port",
        "0",
        "--grace",
        "5",
        "--",
        "rendezvous-check",
        "--timeout",
        "60",
        "--fail-rank",
        "2",
        "--fail-code",
        "7",
    ]);
    run.expect_code(7);
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    assert!(
        run.stderr
            .contains("[rank 2] error: rank 2 fails on purpose"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr
            .contains("rank 2 exited with code 7; stopped the other ranks"),
        "{}",
        run.stderr
    );
}

#[test]
fn launch_checks_its_flags() {
    for (args, needle) in [
        (vec!["launch", "--nproc-per-node", "2"], "after `--`"),
        (
            vec![
                "launch",
                "--nproc-per-node",
                "2",
                "--nnodes",
                "2",
                "--",
                "rendezvous-check",
            ],
            "--master-addr",
        ),
        (
            vec![
                "launch",
                "--nproc-per-node",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--",
                "rendezvous-check",
            ],
            "--node-rank 2 is not below --nnodes 2",
        ),
        (
            vec![
                "launch",
                "--nproc-per-node",
                "0",
                "--master-port",
                "0",
                "--",
                "rendezvous-check",
            ],
            "--nproc-per-node 0",
        ),
        // 2 x (2^63 + 1) wrapped to a world of 2, whose two ranks then met.
        (
            vec![
                "launch",
                "--nproc-per-node",
                "2",
                "--nnodes",
                "9223372036854775809",
                "--node-rank",
                "9223372036854775808",
                "--master-addr",
                "127.0.0.1",
                "--",
                "rendezvous-check",
            ],
            "is over the 65536 ranks a rendezvous takes",
        ),
        (
            vec![
                "launch",
                "--nproc-per-node",
                "1",
                "--",
                "launch",
                "--nproc-per-node",
                "1",
            ],
            "cannot launch again",
        ),
    ] {
        let run = meshplan(&args);
        run.expect_code(2);
        assert!(run.stderr.contains(needle), "{args:?}: {}", run.stderr);
    }
}

/// A launcher of 3 holding ranks, its rank pids once every rank has joined.
fn holding_launch() -> (Child, Vec<u32>, std::thread::JoinHandle<String>) {
    let mut child = command()
        .args([
            "launch",
            "--nproc-per-node",
            "3",
            "--master-port",
            "0",
            "--grace",
            "5",
            "--",
            "rendezvous-check",
            "--timeout",
            "60",
            "--hold",
            "60",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn launch");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut pids = Vec::new();
    let mut seen = String::new();
    for line in lines.by_ref() {
        let line = line.expect("line");
        seen.push_str(&line);
        seen.push('\n');
        if let Some(p) = line
            .strip_prefix("[rank 0]   rank ")
            .and_then(|l| l.rsplit_once("pid "))
        {
            pids.push(p.1.trim().parse::<u32>().expect("pid"));
        }
        if line.contains("every rank holds the same") {
            break;
        }
    }
    assert_eq!(pids.len(), 3, "{seen}");
    // Keep draining so the ranks never block on a full pipe.
    let rest =
        std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>().join("\n"));
    (child, pids, rest)
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(ok.success());
}

#[track_caller]
fn all_dead_within(pids: &[u32], limit: Duration) {
    let t0 = Instant::now();
    while !pids.iter().all(|&p| dead(p)) {
        assert!(
            t0.elapsed() < limit,
            "ranks {pids:?} still alive after {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn launch_forwards_sigterm_to_every_rank() {
    let (mut child, pids, rest) = holding_launch();
    let t0 = Instant::now();
    signal(child.id(), "-TERM");
    let status = child.wait().expect("wait");
    assert!(t0.elapsed() < Duration::from_secs(20));
    // 128 + SIGTERM(15).
    assert_eq!(status.code(), Some(143));
    all_dead_within(&pids, Duration::from_secs(5));
    let _ = rest.join();
}

#[test]
fn ranks_stop_when_the_launcher_is_killed() {
    // SIGKILL leaves the launcher no chance to stop its ranks: they notice the end of
    // the pipe it held as their standard input.
    let (mut child, pids, rest) = holding_launch();
    signal(child.id(), "-KILL");
    let _ = child.wait();
    all_dead_within(&pids, Duration::from_secs(10));
    let _ = rest.join();
}

#[test]
fn run_refuses_a_multi_process_launch_on_the_cpu_backend() {
    let dir = temp_dir("launch-run");
    let plan = plan_file(
        &dir,
        "tiny",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        &["--nodes", "1", "--config", "dp=2,tp=2,pp=2"],
    );
    let p = plan.display().to_string();
    let run = meshplan(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        "0",
        "--",
        "run",
        &p,
        "--steps",
        "1",
    ]);
    run.expect_code(2);
    // The first rank to refuse decides; the launcher may stop the other first.
    assert!(
        (0..2).any(|r| run.stderr.contains(&format!(
            "[rank {r}] error: this process is rank {r} of WORLD_SIZE=2 (RANK={r})"
        ))),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr
            .contains("exited with code 2; stopped the other ranks"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("Start one process"), "{}", run.stderr);
    // One process under a launcher runs the whole plan as threads, as without one.
    let run = meshplan(&[
        "launch",
        "--nproc-per-node",
        "1",
        "--master-port",
        "0",
        "--",
        "run",
        &p,
        "--steps",
        "1",
    ]);
    run.expect_code(0);
    assert!(
        run.stdout.contains("[rank 0] tiny-gpt on 8 ranks"),
        "{}",
        run.stdout
    );
    // `--backend cuda` takes a launch (one process per GPU): here, without a GPU,
    // each process says what its GPU layer lacks, exit 1.
    let run = meshplan(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        "0",
        "--",
        "run",
        &p,
        "--backend",
        "cuda",
        "--steps",
        "1",
    ]);
    if crate::bin::bin_features().is_none() {
        run.expect_code(1);
        assert!(
            run.stderr.contains("--backend cuda: ") && run.stderr.contains("--features cuda"),
            "{}",
            run.stderr
        );
    }
}

/// The `job ID (key from SOURCE)` each rank of a `rendezvous-check` output printed.
fn job_ids(out: &str, n: usize) -> Vec<String> {
    (0..n)
        .map(|r| {
            let prefix = format!("[rank {r}] rank {r}: job ");
            let line = out
                .lines()
                .find(|l| l.starts_with(&prefix))
                .unwrap_or_else(|| panic!("no `{prefix}` in:\n{out}"));
            line[prefix.len()..].to_string()
        })
        .collect()
}

#[test]
fn r16_launch_hands_its_ranks_one_job_token() {
    let args = [
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        "0",
        "--",
        "rendezvous-check",
        "--timeout",
        "30",
    ];
    let launch = || {
        let mut c = command();
        c.env_remove(TOKEN_VAR).args(args);
        let run = finish(&args, &c.output().expect("launch"));
        run.expect_code(0);
        assert!(
            !run.stderr.contains("is not set"),
            "no fallback warning under launch:\n{}",
            run.stderr
        );
        job_ids(&run.stdout, 2)
    };
    let (a, b) = (launch(), launch());
    assert_eq!(a[0], a[1], "the ranks of one launch share a job");
    assert!(a[0].ends_with("(key from MESHPLAN_JOB_TOKEN)"), "{a:?}");
    assert_ne!(a[0], b[0], "two launches are two jobs");
    // A token given to the launcher is checked once, there.
    let mut c = command();
    c.env(TOKEN_VAR, "short").args(args);
    let run = finish(&args, &c.output().expect("launch"));
    run.expect_code(2);
    assert!(
        run.stderr.contains("MESHPLAN_JOB_TOKEN: has 5 characters")
            && run.stderr.contains("openssl rand -hex 32"),
        "{}",
        run.stderr
    );
}

#[test]
fn r16_strangers_killer_frames_and_idle_connections_do_not_stop_a_job() {
    use std::io::{Read, Write};
    let port = free_port();
    let token = Some("issue-16-it-token-0123456789");
    let args = ["rendezvous-check", "--timeout", "20"];
    let r0 = rank_process_with(&args, 0, 3, port, token);
    // 100 idle connections, opened as soon as rank 0 listens and held throughout.
    let t_listen = Instant::now();
    let first = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) if t_listen.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("rank 0 never listened: {e}"),
        }
    };
    let mut idle = vec![first];
    for _ in 0..99 {
        idle.push(std::net::TcpStream::connect(("127.0.0.1", port)).expect("idle"));
    }
    // Killer frames: a hello of protocol version 1, and bytes of another protocol.
    for bytes in [
        {
            let mut f = b"MPRV\x01\x00\x01\x10\x00\x00\x00".to_vec();
            f.extend_from_slice(&[1, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            f
        },
        b"GET / HTTP/1.0\r\n\r\n".to_vec(),
    ] {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("killer");
        s.write_all(&bytes).expect("send");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        assert!(
            String::from_utf8_lossy(&answer).contains("refused this connection"),
            "{answer:?}"
        );
    }
    // A process of another job (its own token), same plan and world size, as rank 1.
    let stranger = wait(
        &args,
        rank_process_with(&args, 1, 3, port, Some("another-job-token-abcdefghij")),
    );
    stranger.expect_code(2);
    assert!(
        stranger.stderr.contains("of another job"),
        "{}",
        stranger.stderr
    );
    // The real ranks join behind all of that.
    let t0 = Instant::now();
    let r1 = rank_process_with(&args, 1, 3, port, token);
    let r2 = rank_process_with(&args, 2, 3, port, token);
    let (r1, r2, r0) = (wait(&args, r1), wait(&args, r2), wait(&args, r0));
    let elapsed = t0.elapsed();
    eprintln!("3 rank processes behind 100 idle connections, 2 killer frames and a stranger joined and finished in {elapsed:?}");
    r1.expect_code(0);
    r2.expect_code(0);
    r0.expect_code(0);
    assert!(
        r0.stdout.contains("rendezvous ok: 3 ranks"),
        "{}",
        r0.stdout
    );
    assert!(elapsed < Duration::from_secs(15), "{elapsed:?}");
    for why in [
        "speaks rendezvous protocol version 1",
        "not a meshplan rendezvous frame",
        "of another job",
    ] {
        assert!(
            r0.stderr.contains("refused 127.0.0.1:") && r0.stderr.contains(why),
            "`{why}` missing from rank 0's log:\n{}",
            r0.stderr
        );
    }
    drop(idle);
}
