//! Where this process sits in a multi-process run: torchrun's variables (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; what
//! `meshplan launch` sets too) or, inside a Slurm job step, Slurm's (`SLURM_PROCID`,
//! `SLURM_NTASKS`, `SLURM_LOCALID`, tasks per node, the step's node list). Each value
//! is taken from torchrun's variable when it is set, else from Slurm's.
//!
//! Slurm's variables count only inside a job step (`srun`, which sets
//! `SLURM_STEP_ID`): a batch script's own `SLURM_PROCID` and `SLURM_NTASKS` describe
//! the allocation, not the process reading them.

use super::nodelist::first_host;

/// torchrun's default rendezvous port.
pub const DEFAULT_MASTER_PORT: u16 = 29_500;

/// Under Slurm without `MASTER_PORT`: `SLURM_PORT_BASE + job id % SLURM_PORT_SPAN`, the
/// same on every task of the job and different for jobs sharing a node.
pub const SLURM_PORT_BASE: u16 = 10_000;
/// See [`SLURM_PORT_BASE`]; the range stays below Linux's ephemeral ports (32768).
pub const SLURM_PORT_SPAN: u16 = 20_000;

/// A launch variable that is missing, malformed or inconsistent with another.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{variable}: {message}")]
pub struct LaunchEnvError {
    /// The variable to fix (as the process saw it).
    pub variable: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

/// The variable each value of a [`LaunchEnv`] came from (or `default`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sources {
    /// `RANK` or `SLURM_PROCID`.
    pub rank: &'static str,
    /// `WORLD_SIZE` or `SLURM_NTASKS`.
    pub world_size: &'static str,
    /// `LOCAL_RANK`, `SLURM_LOCALID` or `default`.
    pub local_rank: &'static str,
    /// `MASTER_ADDR`, a Slurm node list or `default`.
    pub master_addr: &'static str,
    /// `MASTER_PORT`, `SLURM_JOB_ID` or `default`.
    pub master_port: &'static str,
}

/// This process's place in a multi-process run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Processes in the run.
    pub world_size: usize,
    /// Index of this process on its node (its GPU), `0..local_world_size`.
    pub local_rank: usize,
    /// Processes on this node, where the launcher says.
    pub local_world_size: Option<usize>,
    /// Host of rank 0's rendezvous.
    pub master_addr: String,
    /// Port of rank 0's rendezvous.
    pub master_port: u16,
    /// Where each value came from.
    pub sources: Sources,
}

impl LaunchEnv {
    /// Reads the process environment; `None` when no launcher variable is set (a
    /// plain single-process run).
    pub fn from_env() -> Result<Option<LaunchEnv>, LaunchEnvError> {
        LaunchEnv::from_vars(&|k| std::env::var(k).ok())
    }

    /// Reads launch variables through `get` (tests pass a map).
    pub fn from_vars(
        get: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<LaunchEnv>, LaunchEnvError> {
        let var = trimmed(get);
        let torch = var("RANK").is_some() || var("WORLD_SIZE").is_some();
        let slurm = var("SLURM_PROCID").is_some()
            && (var("SLURM_STEP_ID").is_some() || var("SLURM_STEPID").is_some());
        if !torch && !slurm {
            return Ok(None);
        }
        let v = Vars { var: &var, slurm };
        let ((world_var, world), (rank_var, rank)) = v.world_and_rank()?;
        let ((local_rank_var, local_rank), local_world) = v.local((world_var, world))?;
        let ((addr_var, master_addr), (port_var, master_port)) = v.master(world)?;
        Ok(Some(LaunchEnv {
            rank,
            world_size: world,
            local_rank,
            local_world_size: local_world.map(|(_, v)| v),
            master_addr,
            master_port,
            sources: Sources {
                rank: rank_var,
                world_size: world_var,
                local_rank: local_rank_var,
                master_addr: addr_var,
                master_port: port_var,
            },
        }))
    }

    /// `rank 3 of WORLD_SIZE=8` with the variables' names, for messages.
    pub fn describe(&self) -> String {
        format!(
            "rank {} of {}={} ({}={})",
            self.rank, self.sources.world_size, self.world_size, self.sources.rank, self.rank
        )
    }
}

/// The environment as [`LaunchEnv::from_vars`] reads it: trimmed, empty as unset,
/// and whether Slurm's variables count (only inside a Slurm step).
struct Vars<'v> {
    var: &'v dyn Fn(&str) -> Option<String>,
    slurm: bool,
}

type Found<T> = (&'static str, T);

impl Vars<'_> {
    /// The first of `names` that is set, and its value.
    fn pick(&self, names: &[&'static str]) -> Option<Found<String>> {
        names
            .iter()
            .filter(|n| self.slurm || !n.starts_with("SLURM_"))
            .find_map(|&n| (self.var)(n).map(|v| (n, v)))
    }

    /// The world size and this process's rank, each with the variable it came from.
    fn world_and_rank(&self) -> Result<(Found<usize>, Found<usize>), LaunchEnvError> {
        let (world_var, world) = match self.pick(&["WORLD_SIZE", "SLURM_NTASKS"]) {
            Some((n, v)) => (n, count(n, &v)?),
            None => {
                return Err(err(
                    "WORLD_SIZE",
                    "is not set, but RANK is; set WORLD_SIZE to the number of processes of the run (torchrun and `meshplan launch` set both)",
                ))
            }
        };
        if world == 0 {
            return Err(err(world_var, "is 0; a run has at least one process"));
        }
        let (rank_var, rank) = match self.pick(&["RANK", "SLURM_PROCID"]) {
            Some((n, v)) => (n, count(n, &v)?),
            None => {
                return Err(err(
                    "RANK",
                    format!(
                        "is not set, but {world_var}={world} is; set RANK to this process's global rank (0..{})",
                        world - 1
                    ),
                ))
            }
        };
        if rank >= world {
            return Err(err(
                rank_var,
                format!(
                    "{rank_var}={rank} is not below {world_var}={world}: ranks count from 0, so set {rank_var} to 0..{} or {world_var} to the number of processes",
                    world - 1
                ),
            ));
        }
        Ok(((world_var, world), (rank_var, rank)))
    }

    /// The local rank and, when given, the processes on this node.
    fn local(
        &self,
        (world_var, world): Found<usize>,
    ) -> Result<(Found<usize>, Option<Found<usize>>), LaunchEnvError> {
        let (local_rank_var, local_rank) = match self.pick(&["LOCAL_RANK", "SLURM_LOCALID"]) {
            Some((n, v)) => (n, count(n, &v)?),
            None if world == 1 => ("default", 0),
            None => {
                return Err(err(
                    "LOCAL_RANK",
                    "is not set; set it to this process's GPU index on its node (torchrun and `meshplan launch` set it)",
                ))
            }
        };
        let local_world = match self.pick(&["LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"]) {
            Some((n, v)) => Some((n, count(n, &v)?)),
            None => self.slurm_tasks_on_node()?,
        };
        if let Some((n, lw)) = local_world {
            if lw == 0 {
                return Err(err(n, "is 0; a node runs at least one process"));
            }
            if local_rank >= lw {
                return Err(err(
                    local_rank_var,
                    format!(
                        "{local_rank_var}={local_rank} is not below {n}={lw}: local ranks count from 0 on each node"
                    ),
                ));
            }
            if lw > world {
                return Err(err(
                    n,
                    format!("{n}={lw} exceeds {world_var}={world}: a node cannot run more processes than the run has"),
                ));
            }
        }
        Ok(((local_rank_var, local_rank), local_world))
    }

    /// Rank 0's address and port.
    fn master(&self, world: usize) -> Result<(Found<String>, Found<u16>), LaunchEnvError> {
        let (addr_var, master_addr) = match (self.var)("MASTER_ADDR") {
            Some(a) => ("MASTER_ADDR", a),
            None => match self.slurm_first_host()? {
                Some(found) => found,
                None if world == 1 => ("default", "127.0.0.1".to_string()),
                None => {
                    return Err(err(
                        "MASTER_ADDR",
                        "is not set; set it to the host name or address of rank 0's node (torchrun --master-addr, meshplan launch --master-addr)",
                    ))
                }
            },
        };
        let (port_var, master_port) = match (self.var)("MASTER_PORT") {
            Some(p) => ("MASTER_PORT", port("MASTER_PORT", &p)?),
            None if self.slurm => match (self.var)("SLURM_JOB_ID").and_then(|j| j.parse::<u64>().ok()) {
                Some(job) => (
                    "SLURM_JOB_ID",
                    SLURM_PORT_BASE + (job % u64::from(SLURM_PORT_SPAN)) as u16,
                ),
                None => ("default", DEFAULT_MASTER_PORT),
            },
            None if world == 1 => ("default", DEFAULT_MASTER_PORT),
            None => {
                return Err(err(
                    "MASTER_PORT",
                    format!(
                        "is not set; set it to a free TCP port on rank 0's node, the same on every rank (torchrun's default is {DEFAULT_MASTER_PORT})"
                    ),
                ))
            }
        };
        Ok(((addr_var, master_addr), (port_var, master_port)))
    }

    /// Tasks on this node under Slurm (after `SLURM_NTASKS_PER_NODE`): this node's
    /// entry of `SLURM_STEP_TASKS_PER_NODE` / `SLURM_TASKS_PER_NODE` (`2(x3),1`).
    fn slurm_tasks_on_node(&self) -> Result<Option<Found<usize>>, LaunchEnvError> {
        let Some((name, v)) = self.pick(&["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"])
        else {
            return Ok(None);
        };
        let per_node = tasks_per_node(&v).map_err(|m| err(name, m))?;
        let node = match self.pick(&["SLURM_NODEID"]) {
            Some((n, v)) => count(n, &v)?,
            // Without the node index only a uniform list says how many run here.
            None if per_node.windows(2).all(|w| w[0] == w[1]) => 0,
            None => return Ok(None),
        };
        match per_node.get(node) {
            Some(&t) => Ok(Some((name, t))),
            None => Err(err(
                name,
                format!(
                    "{name}={v} lists {} nodes, but SLURM_NODEID={node}",
                    per_node.len()
                ),
            )),
        }
    }

    /// Rank 0's host under Slurm: the first of the step's (else the job's) node list.
    fn slurm_first_host(&self) -> Result<Option<Found<String>>, LaunchEnvError> {
        let names = [
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
        ];
        let Some((name, list)) = self.pick(&names) else {
            return Ok(None);
        };
        first_host(&list).map(|h| Some((name, h))).map_err(|m| {
            err(
                name,
                format!("{m}; set MASTER_ADDR to rank 0's host instead"),
            )
        })
    }
}

/// `get` with values trimmed and an empty value taken as unset.
pub(super) fn trimmed<'g>(
    get: &'g dyn Fn(&str) -> Option<String>,
) -> impl Fn(&str) -> Option<String> + 'g {
    move |k| {
        get(k)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }
}

pub(super) fn err(variable: &str, message: impl Into<String>) -> LaunchEnvError {
    LaunchEnvError {
        variable: variable.to_string(),
        message: message.into(),
    }
}

fn count(name: &str, v: &str) -> Result<usize, LaunchEnvError> {
    v.parse::<usize>().map_err(|_| {
        err(
            name,
            format!("{name}={v} is not a non-negative integer; set it to a number such as 0"),
        )
    })
}

fn port(name: &str, v: &str) -> Result<u16, LaunchEnvError> {
    match v.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(err(
            name,
            format!("{name}={v} is not a TCP port; set it to a number in 1..65535, the same on every rank"),
        )),
    }
}

/// Slurm's tasks-per-node format: `4`, `2(x3),1` -> `[2, 2, 2, 1]`.
pub fn tasks_per_node(v: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in v.split(',') {
        let bad = || format!("`{v}` is not Slurm's tasks-per-node list (e.g. `4` or `2(x3),1`)");
        let (n, times) = match part.split_once("(x") {
            Some((n, rest)) => {
                let t = rest.strip_suffix(')').ok_or_else(bad)?;
                (n, t.parse::<usize>().map_err(|_| bad())?)
            }
            None => (part, 1),
        };
        let n = n.trim().parse::<usize>().map_err(|_| bad())?;
        if out.len() + times > super::nodelist::NODELIST_HOSTS_MAX {
            return Err(bad());
        }
        out.extend(std::iter::repeat_n(n, times));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<Option<LaunchEnv>, LaunchEnvError> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(&move |k| m.get(k).cloned())
    }

    const TORCH: &[(&str, &str)] = &[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node01"),
        ("MASTER_PORT", "29501"),
    ];

    #[test]
    fn nothing_set_is_a_plain_run() {
        assert_eq!(env(&[]).unwrap(), None);
        // A batch script's allocation variables without a step are not a launch.
        assert_eq!(
            env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")]).unwrap(),
            None
        );
    }

    #[test]
    fn torchrun_variables() {
        let e = env(TORCH).unwrap().unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (5, 8, 1));
        assert_eq!(e.local_world_size, Some(4));
        assert_eq!((e.master_addr.as_str(), e.master_port), ("node01", 29501));
        assert_eq!(e.sources.rank, "RANK");
        assert_eq!(e.describe(), "rank 5 of WORLD_SIZE=8 (RANK=5)");
    }

    const SLURM: &[(&str, &str)] = &[
        ("SLURM_PROCID", "6"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "2"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_NODEID", "1"),
        ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
        ("SLURM_STEP_NODELIST", "gpu-[3-4]"),
        ("SLURM_JOB_ID", "123456"),
    ];

    #[test]
    fn slurm_variables_inside_a_step() {
        let e = env(SLURM).unwrap().unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (6, 8, 2));
        assert_eq!(e.local_world_size, Some(4));
        assert_eq!(e.master_addr, "gpu-3");
        // 10000 + 123456 % 20000 = 13456.
        assert_eq!(e.master_port, 13_456);
        assert_eq!(e.sources.master_addr, "SLURM_STEP_NODELIST");
        // torchrun's variables win, one by one.
        let mut v = SLURM.to_vec();
        v.extend([
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("RANK", "0"),
        ]);
        let e = env(&v).unwrap().unwrap();
        assert_eq!((e.rank, e.master_port), (0, 29500));
        assert_eq!(e.master_addr, "10.0.0.1");
        assert_eq!(e.sources.world_size, "SLURM_NTASKS");
    }

    #[test]
    fn slurm_tasks_per_node_forms() {
        assert_eq!(tasks_per_node("4").unwrap(), [4]);
        assert_eq!(tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert!(tasks_per_node("2(x3").is_err());
        assert!(tasks_per_node("x").is_err());
        let mut v = SLURM.to_vec();
        v.retain(|(k, _)| *k != "SLURM_STEP_TASKS_PER_NODE");
        v.push(("SLURM_NTASKS_PER_NODE", "4"));
        assert_eq!(env(&v).unwrap().unwrap().local_world_size, Some(4));
        // An uneven list without the node index leaves the local size unknown.
        let mut v = SLURM.to_vec();
        v.retain(|(k, _)| *k != "SLURM_NODEID" && *k != "SLURM_STEP_TASKS_PER_NODE");
        v.push(("SLURM_TASKS_PER_NODE", "5,3"));
        assert_eq!(env(&v).unwrap().unwrap().local_world_size, None);
    }

    #[track_caller]
    fn refused(pairs: &[(&str, &str)], variable: &str, needles: &[&str]) {
        let e = env(pairs).expect_err("refused");
        assert_eq!(e.variable, variable, "{e}");
        let text = e.to_string();
        for n in needles {
            assert!(text.contains(n), "`{n}` missing from: {text}");
        }
    }

    #[test]
    fn bad_values_name_the_variable_and_the_fix() {
        let with = |k: &'static str, v: &'static str| {
            let mut p: Vec<(&str, &str)> = TORCH.iter().filter(|(n, _)| *n != k).copied().collect();
            if !v.is_empty() {
                p.push((k, v));
            }
            p
        };
        refused(
            &with("RANK", "8"),
            "RANK",
            &["RANK=8 is not below WORLD_SIZE=8", "0..7"],
        );
        refused(
            &with("RANK", "two"),
            "RANK",
            &["RANK=two is not a non-negative integer"],
        );
        refused(&with("WORLD_SIZE", "0"), "WORLD_SIZE", &["is 0"]);
        refused(
            &with("WORLD_SIZE", ""),
            "WORLD_SIZE",
            &["is not set, but RANK is"],
        );
        refused(
            &with("LOCAL_RANK", "4"),
            "LOCAL_RANK",
            &["LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"],
        );
        refused(&with("LOCAL_RANK", ""), "LOCAL_RANK", &["GPU index"]);
        refused(
            &with("LOCAL_WORLD_SIZE", "16"),
            "LOCAL_WORLD_SIZE",
            &["exceeds WORLD_SIZE=8"],
        );
        refused(
            &with("MASTER_ADDR", ""),
            "MASTER_ADDR",
            &["rank 0's node", "--master-addr"],
        );
        refused(
            &with("MASTER_PORT", ""),
            "MASTER_PORT",
            &["free TCP port", "29500"],
        );
        refused(&with("MASTER_PORT", "70000"), "MASTER_PORT", &["1..65535"]);
        refused(&[("WORLD_SIZE", "4")], "RANK", &["WORLD_SIZE=4 is", "0..3"]);
        let mut v = SLURM.to_vec();
        v.retain(|(k, _)| *k != "SLURM_PROCID");
        v.push(("SLURM_PROCID", "9"));
        refused(
            &v,
            "SLURM_PROCID",
            &["SLURM_PROCID=9 is not below SLURM_NTASKS=8"],
        );
        let mut v = SLURM.to_vec();
        v.retain(|(k, _)| *k != "SLURM_STEP_NODELIST");
        v.push(("SLURM_JOB_NODELIST", "gpu-[3-"));
        refused(
            &v,
            "SLURM_JOB_NODELIST",
            &["without `]`", "set MASTER_ADDR"],
        );
    }

    #[test]
    fn one_process_needs_no_rendezvous_address() {
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap().unwrap();
        assert_eq!((e.local_rank, e.master_addr.as_str()), (0, "127.0.0.1"));
        assert_eq!(e.master_port, DEFAULT_MASTER_PORT);
    }
}
