//! Peer authentication: a shared secret per deployment, proven by
//! HMAC-SHA256 challenge-response in both directions.
//!
//! Every worker of a deployment reads the same secret file
//! (`pd_auth_secret_file`, or the file named by the
//! `ASCEND_PD_AUTH_SECRET_FILE` environment variable, which wins). Two
//! exchanges use it:
//!
//! - the channel handshake (`channel::handshake`): the connecting side
//!   sends a fresh nonce; the listening side answers with its own nonce and
//!   a proof over both; the connecting side checks it before sending its
//!   hello (buffer table, endpoint), which carries its own proof over the
//!   nonces and the hello's bytes; the answer carries a proof over its
//!   bytes too. Nothing about the pools leaves either side before the other
//!   proved it holds the secret, and neither hello can be altered on the way.
//! - every `tcp` transfer connection: the server answers the client's
//!   hello nonce with its nonce and proof; the client proves itself over
//!   the same nonces and its node id, so the grants the server checks name
//!   an authenticated peer.
//!
//! Proofs are `HMAC-SHA256(secret, label ‖ parts…)`, each part prefixed by
//! its length so no two inputs encode alike; labels keep a proof made for
//! one step from being replayed at another. Nonces are 16 bytes from the
//! operating system's generator, never reused. Payload bytes after the
//! handshakes are not authenticated (no per-request MAC); see the README.
//!
//! Without a secret the product runs as before on a trusted fabric, and
//! says so once at start-up ([`warn_unauthenticated_once`]).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The config key naming the secret file.
pub const SECRET_KEY: &str = "pd_auth_secret_file";
/// The environment variable that overrides [`SECRET_KEY`].
pub const SECRET_ENV: &str = "ASCEND_PD_AUTH_SECRET_FILE";
/// Fewest secret bytes accepted.
pub const MIN_SECRET_BYTES: usize = 16;
/// Most secret bytes read (a secret is a key, not a document).
pub const MAX_SECRET_BYTES: usize = 4096;
/// Bytes in a nonce.
pub const NONCE_LEN: usize = 16;
/// Bytes in a proof.
pub const PROOF_LEN: usize = 32;

/// A nonce.
pub type Nonce = [u8; NONCE_LEN];
/// A proof.
pub type Proof = [u8; PROOF_LEN];

/// What a proof is for (so a proof of one step is worthless at another).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The handshake's listening side answering the challenge.
    HandshakeServer,
    /// The connecting side's hello.
    HandshakeHello,
    /// The listening side's answering hello.
    HandshakeAnswer,
    /// A tcp transfer server answering a connection's nonce.
    TcpServer,
    /// A tcp transfer client proving its node.
    TcpClient,
}

impl Step {
    fn label(self) -> &'static [u8] {
        match self {
            Step::HandshakeServer => b"ascend-pd/handshake/server",
            Step::HandshakeHello => b"ascend-pd/handshake/hello",
            Step::HandshakeAnswer => b"ascend-pd/handshake/answer",
            Step::TcpServer => b"ascend-pd/tcp/server",
            Step::TcpClient => b"ascend-pd/tcp/client",
        }
    }
}

/// Why a secret could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("{SECRET_KEY} ({source_name}) {path}: {reason}")]
pub struct SecretError {
    /// The file.
    pub path: PathBuf,
    /// Where the path came from (the key or the environment variable).
    pub source_name: String,
    /// What is wrong, and the fix.
    pub reason: String,
}

/// The deployment's shared secret. Cheap to clone; never printed.
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// A secret from its bytes (at least [`MIN_SECRET_BYTES`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<Secret, String> {
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "the secret has {} bytes; use at least {MIN_SECRET_BYTES} random bytes \
                 (e.g. `head -c 32 /dev/urandom | base64 > FILE`)",
                bytes.len()
            ));
        }
        if bytes.len() > MAX_SECRET_BYTES {
            return Err(format!(
                "the secret has {} bytes; at most {MAX_SECRET_BYTES} are accepted",
                bytes.len()
            ));
        }
        Ok(Secret(bytes.into()))
    }

    /// Reads the secret file: its bytes, less one trailing newline (`\n`
    /// or `\r\n`), so `echo … > file` and editors work as expected.
    pub fn load(path: &Path, source_name: &str) -> Result<Secret, SecretError> {
        let err = |reason: String| SecretError {
            path: path.to_path_buf(),
            source_name: source_name.to_string(),
            reason,
        };
        let meta = std::fs::metadata(path).map_err(|e| err(format!("cannot read it: {e}")))?;
        if !meta.is_file() {
            return Err(err("not a regular file".into()));
        }
        if meta.len() > MAX_SECRET_BYTES as u64 + 2 {
            return Err(err(format!(
                "{} bytes; a secret has at most {MAX_SECRET_BYTES}",
                meta.len()
            )));
        }
        let bytes = std::fs::read(path).map_err(|e| err(format!("cannot read it: {e}")))?;
        let trimmed = bytes
            .strip_suffix(b"\r\n")
            .or_else(|| bytes.strip_suffix(b"\n"))
            .unwrap_or(&bytes);
        let secret = Secret::from_bytes(trimmed).map_err(err)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if meta.permissions().mode() & 0o077 != 0 {
                log::warn!(
                    "{SECRET_KEY} {}: readable by other users (mode {:o}); `chmod 600` it",
                    path.display(),
                    meta.permissions().mode() & 0o777
                );
            }
        }
        Ok(secret)
    }

    /// The secret named by the environment (which wins) or by `configured`
    /// (the config key); `None` when neither names one.
    pub fn from_env_or(configured: Option<&Path>) -> Result<Option<Secret>, SecretError> {
        match std::env::var_os(SECRET_ENV).filter(|v| !v.is_empty()) {
            Some(p) => Secret::load(Path::new(&p), SECRET_ENV).map(Some),
            None => configured.map(|p| Secret::load(p, SECRET_KEY)).transpose(),
        }
    }

    fn mac(&self, step: Step, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        m.update(step.label());
        for p in parts {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }

    /// The proof for `step` over `parts`.
    pub fn prove(&self, step: Step, parts: &[&[u8]]) -> Proof {
        self.mac(step, parts).finalize().into_bytes().into()
    }

    /// Whether `proof` is the proof for `step` over `parts` (compared in
    /// constant time).
    pub fn verify(&self, step: Step, parts: &[&[u8]], proof: &[u8]) -> bool {
        self.mac(step, parts).verify_slice(proof).is_ok()
    }
}

/// A fresh nonce from the operating system's generator.
pub fn nonce() -> Nonce {
    let mut n = [0u8; NONCE_LEN];
    // The OS generator failing is not something to run on without.
    getrandom::fill(&mut n).expect("the operating system's random generator failed");
    n
}

/// Says once per process that the data plane is unauthenticated.
pub fn warn_unauthenticated_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        log::warn!(
            "the data plane is unauthenticated: any host that reaches this worker's ports can \
             attach, and read or write the pages it is granted. Set {SECRET_KEY} (or \
             {SECRET_ENV}) to the same secret file on every worker of the deployment"
        );
    });
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Exactly `N` bytes from lowercase or uppercase hex.
pub(crate) fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(b: u8) -> Secret {
        Secret::from_bytes(&[b; 32]).unwrap()
    }

    #[test]
    fn a_proof_verifies_only_with_the_same_secret_step_and_parts() {
        let (a, b) = (secret(1), secret(2));
        let p = a.prove(Step::TcpClient, &[b"n1", b"node"]);
        assert!(a.verify(Step::TcpClient, &[b"n1", b"node"], &p));
        assert!(
            !b.verify(Step::TcpClient, &[b"n1", b"node"], &p),
            "other secret"
        );
        assert!(
            !a.verify(Step::TcpServer, &[b"n1", b"node"], &p),
            "other step"
        );
        assert!(
            !a.verify(Step::TcpClient, &[b"n1n", b"ode"], &p),
            "parts are framed"
        );
        assert!(!a.verify(Step::TcpClient, &[b"n1", b"node"], &p[..31]));
    }

    #[test]
    fn secrets_are_checked_and_files_lose_one_trailing_newline() {
        let e = Secret::from_bytes(b"short").unwrap_err();
        assert!(e.contains("at least 16"), "{e}");
        let dir = std::env::temp_dir().join(format!("apd-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("s");
        std::fs::write(&f, b"0123456789abcdef0123\n").unwrap();
        let s = Secret::load(&f, SECRET_KEY).unwrap();
        let bare = Secret::from_bytes(b"0123456789abcdef0123").unwrap();
        let p = s.prove(Step::TcpServer, &[]);
        assert!(bare.verify(Step::TcpServer, &[], &p));
        let e = Secret::load(&dir.join("missing"), SECRET_KEY)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("pd_auth_secret_file") && e.contains("missing"),
            "{e}"
        );
        assert_eq!(format!("{s:?}"), "Secret(..)", "never printed");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn nonces_differ_and_hex_round_trips() {
        let (a, b) = (nonce(), nonce());
        assert_ne!(a, b);
        assert_eq!(unhex::<NONCE_LEN>(&hex(&a)), Some(a));
        assert_eq!(unhex::<2>("zz00"), None);
        assert_eq!(unhex::<2>("00"), None);
    }
}
