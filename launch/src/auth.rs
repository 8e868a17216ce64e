//! The job secret of a multi-process run ([`JobSecret`]) and the message
//! authentication codes of the rendezvous handshake.
//!
//! # Where the secret comes from
//!
//! 1. `MESHPLAN_JOB_TOKEN`, the same string on every rank: `meshplan launch` makes a
//!    random one for a single-node launch; on several nodes, under torchrun or by
//!    hand, export one before starting the ranks (e.g. `openssl rand -hex 32`).
//! 2. Otherwise, inside a Slurm job step, `SLURM_JOB_ID`: enough to keep two jobs
//!    apart, but anyone who can list the cluster's jobs knows it, so it keeps no
//!    hostile user out.
//! 3. Otherwise a fixed, public key: the handshake still runs (so two jobs can be
//!    told apart by plan and world size), but any process that knows the plan hash
//!    could join; rank 0 warns.
//!
//! The token itself never leaves the process: the rendezvous key is a hash of it, the
//! job id (sent in clear so that two jobs on one port are told apart) a hash of the
//! key, and the handshake exchanges only HMAC-SHA256 tags over fresh nonces.

use super::env::{err, trimmed, LaunchEnvError};
use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};
use std::fmt;

/// The environment variable holding the job's secret.
pub const TOKEN_VAR: &str = "MESHPLAN_JOB_TOKEN";
/// Shortest token accepted: shorter ones can be guessed from one recorded handshake.
pub const TOKEN_CHARS_MIN: usize = 16;
/// Longest token accepted (a token is a line of text, not a file).
pub const TOKEN_CHARS_MAX: usize = 4096;
/// Bytes of the job id sent in every `hello`.
pub const JOB_ID_BYTES: usize = 16;
/// Bytes of a handshake nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
pub const MAC_BYTES: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// Where a [`JobSecret`] came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SecretSource {
    /// `MESHPLAN_JOB_TOKEN`.
    Token,
    /// Derived from this Slurm job id (no token set).
    SlurmJob(String),
    /// No token and no Slurm job: a fixed, public key.
    Open,
}

/// The key every rank of one job shares, and the job id derived from it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret {
    key: [u8; 32],
    job_id: [u8; JOB_ID_BYTES],
    source: SecretSource,
}

// The key must not end up in logs or panic messages.
impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobSecret")
            .field("job_id", &self.job_id_hex())
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl JobSecret {
    /// The secret of a `MESHPLAN_JOB_TOKEN` value.
    ///
    /// # Errors
    /// A token shorter than [`TOKEN_CHARS_MIN`] or longer than [`TOKEN_CHARS_MAX`].
    pub fn from_token(token: &str) -> Result<JobSecret, LaunchEnvError> {
        let n = token.chars().count();
        if !(TOKEN_CHARS_MIN..=TOKEN_CHARS_MAX).contains(&n) {
            return Err(err(
                TOKEN_VAR,
                format!(
                    "has {n} characters; give every rank of the job the same token of {TOKEN_CHARS_MIN} to {TOKEN_CHARS_MAX} characters, e.g. `export {TOKEN_VAR}=$(openssl rand -hex 32)`"
                ),
            ));
        }
        Ok(JobSecret::derive(
            b"token\0",
            token.as_bytes(),
            SecretSource::Token,
        ))
    }

    /// The secret derived from a Slurm job id.
    pub fn from_slurm_job(job_id: &str) -> JobSecret {
        JobSecret::derive(
            b"slurm\0",
            job_id.as_bytes(),
            SecretSource::SlurmJob(job_id.to_string()),
        )
    }

    /// The fixed, public key of a run with neither a token nor a Slurm job.
    pub fn open() -> JobSecret {
        JobSecret::derive(b"open\0", b"", SecretSource::Open)
    }

    /// This process's secret: `MESHPLAN_JOB_TOKEN`, else `SLURM_JOB_ID`, else open.
    ///
    /// # Errors
    /// A `MESHPLAN_JOB_TOKEN` of the wrong length, or not UTF-8.
    pub fn from_env() -> Result<JobSecret, LaunchEnvError> {
        // A token that is not text must not pass for no token at all.
        if std::env::var_os(TOKEN_VAR).is_some_and(|v| v.to_str().is_none()) {
            return Err(err(
                TOKEN_VAR,
                "is not UTF-8 text; give every rank the same token of letters and digits, e.g. `export MESHPLAN_JOB_TOKEN=$(openssl rand -hex 32)`",
            ));
        }
        JobSecret::from_vars(&|k| std::env::var(k).ok())
    }

    /// As [`JobSecret::from_env`], reading variables through `get`.
    ///
    /// # Errors
    /// A `MESHPLAN_JOB_TOKEN` of the wrong length.
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<JobSecret, LaunchEnvError> {
        let var = trimmed(get);
        if let Some(t) = var(TOKEN_VAR) {
            return JobSecret::from_token(&t);
        }
        Ok(match var("SLURM_JOB_ID") {
            Some(job) => JobSecret::from_slurm_job(&job),
            None => JobSecret::open(),
        })
    }

    /// Domain-separated so that a token, a Slurm job id and the open key never give
    /// the same key, and the job id reveals nothing usable about the key.
    fn derive(kind: &[u8], material: &[u8], source: SecretSource) -> JobSecret {
        let sha = |parts: &[&[u8]]| {
            let h = parts.iter().fold(Sha256::new(), |h, p| h.chain_update(p));
            h.finalize()
        };
        let key: [u8; 32] = sha(&[b"meshplan rendezvous key v2\0", kind, material]).into();
        let digest = sha(&[b"meshplan job id v2\0", &key]);
        let mut job_id = [0u8; JOB_ID_BYTES];
        job_id.copy_from_slice(&digest[..JOB_ID_BYTES]);
        JobSecret {
            key,
            job_id,
            source,
        }
    }

    /// A fresh random token (64 hex digits) for `meshplan launch` to hand its ranks.
    ///
    /// # Errors
    /// The operating system's random source failed.
    pub fn generate_token() -> Result<String, String> {
        random32(TOKEN_VAR).map(|b| hex(&b))
    }

    /// The job id, sent in clear in every `hello`.
    pub fn job_id(&self) -> [u8; JOB_ID_BYTES] {
        self.job_id
    }

    /// The job id as 32 hex digits, for messages.
    pub fn job_id_hex(&self) -> String {
        hex(&self.job_id)
    }

    /// Where the secret came from.
    pub fn source(&self) -> &SecretSource {
        &self.source
    }

    /// Whether only the job's own processes can hold this key (a token was given).
    pub fn is_private(&self) -> bool {
        self.source == SecretSource::Token
    }

    /// What rank 0 should warn about this secret, if anything.
    pub fn warning(&self) -> Option<String> {
        match &self.source {
            SecretSource::Token => None,
            SecretSource::SlurmJob(id) => Some(format!(
                "{TOKEN_VAR} is not set: the rendezvous key is derived from SLURM_JOB_ID={id}, which keeps other jobs out but not a user who can list this job; export {TOKEN_VAR}=$(openssl rand -hex 32) before srun to keep strangers out"
            )),
            SecretSource::Open => Some(format!(
                "{TOKEN_VAR} is not set: any process that can reach the rendezvous port and knows the plan may join as a rank; `meshplan launch` sets one, otherwise export the same {TOKEN_VAR} (e.g. $(openssl rand -hex 32)) on every rank"
            )),
        }
    }

    /// `HMAC-SHA256(key, label || parts...)`, each part prefixed by its length so that
    /// no two different transcripts hash alike.
    pub(crate) fn mac(&self, label: &[u8], parts: &[&[u8]]) -> [u8; MAC_BYTES] {
        self.mac_state(label, parts).finalize().into_bytes().into()
    }

    /// Checks `tag` against the MAC of `label || parts` in constant time.
    pub(crate) fn verify(&self, label: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
        self.mac_state(label, parts).verify_slice(tag).is_ok()
    }

    fn mac_state(&self, label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
        let mut m = match HmacSha256::new_from_slice(&self.key) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC takes a key of any length"),
        };
        m.update(label);
        for p in parts {
            m.update(&(p.len() as u32).to_le_bytes());
            m.update(p);
        }
        m
    }
}

/// Fresh random bytes for a handshake nonce.
pub(crate) fn nonce() -> Result<[u8; NONCE_BYTES], String> {
    random32("a rendezvous nonce")
}

/// 32 fresh random bytes for `what`.
fn random32(what: &str) -> Result<[u8; 32], String> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| format!("no random bytes for {what}: {e}"))?;
    Ok(b)
}

/// Lower-case hex digits of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    let mut s = String::with_capacity(2 * bytes.len());
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(pairs: &[(&str, &str)]) -> Result<JobSecret, LaunchEnvError> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        JobSecret::from_vars(&move |k| m.get(k).cloned())
    }

    #[test]
    fn token_then_slurm_then_open() {
        let t = from(&[(TOKEN_VAR, "0123456789abcdef0123"), ("SLURM_JOB_ID", "77")]).unwrap();
        assert_eq!(t.source(), &SecretSource::Token);
        assert!(t.is_private());
        assert!(t.warning().is_none());
        let s = from(&[("SLURM_JOB_ID", "77")]).unwrap();
        assert_eq!(s.source(), &SecretSource::SlurmJob("77".into()));
        assert!(s.warning().unwrap().contains("SLURM_JOB_ID=77"));
        let o = from(&[]).unwrap();
        assert_eq!(o.source(), &SecretSource::Open);
        assert!(o.warning().unwrap().contains("any process"));
        // Different secrets, different job ids; the same secret, the same one.
        let ids = [t.job_id(), s.job_id(), o.job_id()];
        assert_ne!(ids[0], ids[1]);
        assert_ne!(ids[1], ids[2]);
        assert_eq!(JobSecret::open().job_id(), o.job_id());
        assert_eq!(
            from(&[(TOKEN_VAR, " 0123456789abcdef0123 ")])
                .unwrap()
                .job_id(),
            t.job_id()
        );
    }

    #[test]
    fn job_ids_are_pinned() {
        // SHA-256 of the documented inputs: a change here splits old and new ranks.
        let t = JobSecret::from_token("0123456789abcdef0123").unwrap();
        assert_eq!(t.job_id_hex(), "6bb15eb4095165599a685d984c221732");
        assert_eq!(
            JobSecret::open().job_id_hex(),
            "ac5985288b8030713c723cd97bf9f302"
        );
    }

    #[test]
    fn a_short_token_is_refused_naming_the_variable_and_the_fix() {
        let e = from(&[(TOKEN_VAR, "hunter2")]).unwrap_err();
        assert_eq!(e.variable, TOKEN_VAR);
        assert!(e.message.contains("has 7 characters"), "{e}");
        assert!(e.message.contains("openssl rand -hex 32"), "{e}");
    }

    #[test]
    fn debug_hides_the_key_and_generated_tokens_differ() {
        let t = JobSecret::from_token("0123456789abcdef0123").unwrap();
        let text = format!("{t:?}");
        assert!(!text.contains("key"), "{text}");
        let (a, b) = (
            JobSecret::generate_token().unwrap(),
            JobSecret::generate_token().unwrap(),
        );
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
        assert!(JobSecret::from_token(&a).is_ok());
    }

    #[test]
    fn macs_bind_every_part_and_its_boundaries() {
        let k = JobSecret::from_token("0123456789abcdef0123").unwrap();
        let tag = k.mac(b"L", &[b"ab", b"c"]);
        assert!(k.verify(b"L", &[b"ab", b"c"], &tag));
        assert!(!k.verify(b"L", &[b"a", b"bc"], &tag));
        assert!(!k.verify(b"M", &[b"ab", b"c"], &tag));
        assert!(!k.verify(b"L", &[b"ab", b"c"], &tag[..31]));
        let other = JobSecret::from_token("0123456789abcdef0124").unwrap();
        assert!(!other.verify(b"L", &[b"ab", b"c"], &tag));
    }
}
