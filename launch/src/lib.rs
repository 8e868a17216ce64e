//! Processes as ranks: where a process sits in a multi-process run ([`LaunchEnv`],
//! from torchrun's or Slurm's variables), the TCP [`Rendezvous`] through which the
//! processes find each other and share the NCCL unique id, the job secret
//! ([`JobSecret`], from `MESHPLAN_JOB_TOKEN`) with which they prove to each other
//! that they belong to one job, and the `meshplan launch` supervisor
//! ([`spawn::launch`]) that starts a node's ranks.
//!
//! The CPU backend runs every rank as a thread of one process (the executor's
//! `ThreadComm`); processes matter for the CUDA backend, one per GPU, with NCCL
//! between them.
//!
//! A crate of its own below the executor: none of it knows plans, devices or
//! communicators, and `meshplan calibrate` and `meshplan launch` use it without
//! running a plan.

pub mod auth;
pub mod env;
pub mod nodelist;
pub mod rendezvous;
pub mod spawn;

#[cfg(test)]
mod tests;

pub use auth::{JobSecret, SecretSource};
pub use env::{LaunchEnv, LaunchEnvError};
pub use rendezvous::{fnv1a64, Rendezvous, RendezvousConfig, RendezvousError};
pub use spawn::{check_options, launch, watch_launcher, LaunchOptions, LaunchOutcome};

/// This machine's host name (for the rank -> node map); `localhost` if unknown.
pub fn hostname() -> String {
    #[cfg(unix)]
    {
        if let Ok(h) = nix::unistd::gethostname() {
            if let Some(s) = h.to_str().filter(|s| !s.is_empty()) {
                return s.to_string();
            }
        }
    }
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}
