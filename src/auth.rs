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
//! operating system's generator, never reused.
//!
//! After the channel handshake, every side-channel frame between the two
//! attached sides is sealed in an envelope ([`Session`]): the handshake's
//! nonces and both node ids give per-attachment keys, one per direction;
//! each frame carries the attachment's id, a per-direction counter and a
//! MAC over both and the message. A frame that does not open (wrong key,
//! altered byte, replayed counter, other attachment, other socket) is
//! dropped and counted by the shell, never acted on. Frames before an
//! attachment (the clock and incarnation probe) carry a fresh challenge
//! nonce that the answer's proof covers ([`Step::ClockAnswer`]); the hccl
//! liveness link's opening bytes carry a proof over its session and root
//! info ([`Step::HcclWatch`]), so nobody else can open it first. See docs/networking.md for what this changes on the wire.
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
    /// A clock / incarnation probe's answer, over the probe's nonce.
    ClockAnswer,
    /// The opening bytes of an hccl liveness link, over its session.
    HcclWatch,
    /// The key of side-channel frames a sender seals for its receiver.
    SessionToReceiver,
    /// The key of side-channel frames a receiver seals for its sender.
    SessionToSender,
    /// A decode's registration for a parked transfer, over its nonce.
    Register,
    /// A prefill's answer to a registration, over the registration's nonce.
    RegisterAnswer,
}

impl Step {
    fn label(self) -> &'static [u8] {
        match self {
            Step::HandshakeServer => b"ascend-pd/handshake/server",
            Step::HandshakeHello => b"ascend-pd/handshake/hello",
            Step::HandshakeAnswer => b"ascend-pd/handshake/answer",
            Step::TcpServer => b"ascend-pd/tcp/server",
            Step::TcpClient => b"ascend-pd/tcp/client",
            Step::ClockAnswer => b"ascend-pd/probe/answer",
            Step::HcclWatch => b"ascend-pd/hccl/watch",
            Step::SessionToReceiver => b"ascend-pd/session/to-receiver",
            Step::SessionToSender => b"ascend-pd/session/to-sender",
            Step::Register => b"ascend-pd/register/request",
            Step::RegisterAnswer => b"ascend-pd/register/answer",
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

/// Bytes of an attachment id (the listening side's handshake nonce).
pub const ATTACHMENT_ID_LEN: usize = NONCE_LEN;
/// Which attachment a sealed frame belongs to.
pub type AttachmentId = [u8; ATTACHMENT_ID_LEN];
/// First bytes of a sealed frame. A msgpack map (every unsealed
/// side-channel frame) starts with a byte in `0x80..=0x8f` or `0xde`/`0xdf`,
/// never `A`, so the two cannot be mistaken for each other.
pub const ENVELOPE_MAGIC: &[u8; 4] = b"APDS";
/// The envelope's format version.
pub const ENVELOPE_VERSION: u8 = 1;
/// Bytes before the message: magic, version, kind, attachment id, counter.
pub const ENVELOPE_HEADER: usize = 4 + 1 + 1 + ATTACHMENT_ID_LEN + 8;
/// Bytes a seal adds to a message (header and MAC).
pub const ENVELOPE_OVERHEAD: usize = ENVELOPE_HEADER + PROOF_LEN;
/// How far behind the highest counter seen a frame may arrive and still be
/// taken (once): frames of one direction travel on several sockets (the
/// request socket, replaced after a timeout; the done socket; the probe).
pub const REPLAY_WINDOW: u64 = 1024;

/// Which socket a sealed frame was made for (covered by the MAC, so a frame
/// captured on one socket is refused on another).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Sender → receiver on the request socket (or the query port).
    Request = 1,
    /// Receiver → sender: the answer on the request socket.
    Reply = 2,
    /// Receiver → sender on the PullDoneSignal socket.
    Done = 3,
}

/// Which end of an attachment holds a [`Session`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The connecting side (a sender).
    Sender,
    /// The listening side (a receiver).
    Receiver,
}

/// Why a sealed frame was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// Shorter than an envelope, or not an envelope at all.
    #[error("not a sealed frame (a peer without the deployment secret, or garbage)")]
    NotSealed,
    /// Made for another socket.
    #[error("sealed for another socket")]
    WrongKind,
    /// Names no attachment of this side (or another one than expected).
    #[error("names no attachment of this side")]
    UnknownAttachment,
    /// The MAC does not verify: altered, or sealed with another key.
    #[error("its MAC does not verify (altered, or not sealed by the attached peer)")]
    BadMac,
    /// Its counter was seen already, or is too far behind.
    #[error("replayed (its counter was seen already or is too old)")]
    Replayed,
}

/// Counters seen in one direction: the highest, and which of the
/// [`REPLAY_WINDOW`] below it were seen.
#[derive(Clone, Debug, Default)]
pub struct ReplayWindow {
    highest: u64,
    /// Bit `d` (word `d / 64`, bit `d % 64`): counter `highest - d` was seen.
    seen: [u64; (REPLAY_WINDOW / 64) as usize],
}

impl ReplayWindow {
    /// Takes `counter` once: false for 0, a counter seen before, or one
    /// [`REPLAY_WINDOW`] or more behind the highest.
    pub fn accept(&mut self, counter: u64) -> bool {
        if counter == 0 {
            return false;
        }
        if counter > self.highest {
            self.shift(counter - self.highest);
            self.highest = counter;
            self.seen[0] |= 1;
            return true;
        }
        let d = self.highest - counter;
        if d >= REPLAY_WINDOW {
            return false;
        }
        let (w, b) = ((d / 64) as usize, d % 64);
        if self.seen[w] & (1 << b) != 0 {
            return false;
        }
        self.seen[w] |= 1 << b;
        true
    }

    /// Ages every bit by `by` counters.
    fn shift(&mut self, by: u64) {
        if by >= REPLAY_WINDOW {
            self.seen = Default::default();
            return;
        }
        let (ws, bs) = ((by / 64) as usize, (by % 64) as u32);
        for i in (0..self.seen.len()).rev() {
            let mut v = 0;
            if i >= ws {
                v = self.seen[i - ws] << bs;
                if bs > 0 && i > ws {
                    v |= self.seen[i - ws - 1] >> (64 - bs);
                }
            }
            self.seen[i] = v;
        }
    }
}

/// The keys and counters of one attachment, held by each end: frames it
/// seals for the other end, and frames it opens from it. Derived from the
/// handshake that made the attachment, so only the two ends of that
/// handshake hold them; an attacker who saw every byte of it does not.
pub struct Session {
    id: AttachmentId,
    seal_key: Proof,
    open_key: Proof,
    sent: std::sync::atomic::AtomicU64,
    seen: std::sync::Mutex<ReplayWindow>,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Session({})", hex(&self.id))
    }
}

impl Session {
    /// The session of the attachment whose handshake used the connecting
    /// side's nonce `client` and the listening side's `server`, between
    /// the nodes `sender` and `receiver`, as `end` holds it. Its id is the
    /// listening side's nonce (fresh per handshake).
    pub fn derive(
        secret: &Secret,
        end: End,
        client: &Nonce,
        server: &Nonce,
        sender: &str,
        receiver: &str,
    ) -> Session {
        let parts: [&[u8]; 4] = [client, server, sender.as_bytes(), receiver.as_bytes()];
        let to_receiver = secret.prove(Step::SessionToReceiver, &parts);
        let to_sender = secret.prove(Step::SessionToSender, &parts);
        let (seal_key, open_key) = match end {
            End::Sender => (to_receiver, to_sender),
            End::Receiver => (to_sender, to_receiver),
        };
        Session {
            id: *server,
            seal_key,
            open_key,
            sent: std::sync::atomic::AtomicU64::new(0),
            seen: std::sync::Mutex::new(ReplayWindow::default()),
        }
    }

    /// The attachment id its frames carry.
    pub fn id(&self) -> &AttachmentId {
        &self.id
    }

    /// `message` sealed for the other end, for the socket `kind`, under the
    /// next counter of this direction.
    pub fn seal(&self, kind: FrameKind, message: &[u8]) -> Vec<u8> {
        let counter = self.sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let mut out = Vec::with_capacity(ENVELOPE_OVERHEAD + message.len());
        out.extend_from_slice(ENVELOPE_MAGIC);
        out.push(ENVELOPE_VERSION);
        out.push(kind as u8);
        out.extend_from_slice(&self.id);
        out.extend_from_slice(&counter.to_be_bytes());
        out.extend_from_slice(message);
        let mac = envelope_mac(&self.seal_key, &out).finalize().into_bytes();
        out.extend_from_slice(&mac);
        out
    }

    /// The message of `frame`, a frame the other end sealed for the socket
    /// `kind` and that this end has not opened before. Nothing is recorded
    /// unless the MAC verifies (a forged counter cannot shift the window).
    pub fn open<'f>(&self, kind: FrameKind, frame: &'f [u8]) -> Result<&'f [u8], OpenError> {
        let (id, got_kind) = envelope_header(frame).ok_or(OpenError::NotSealed)?;
        if id != self.id {
            return Err(OpenError::UnknownAttachment);
        }
        if got_kind != kind as u8 {
            return Err(OpenError::WrongKind);
        }
        let (body, mac) = frame.split_at(frame.len() - PROOF_LEN);
        envelope_mac(&self.open_key, body)
            .verify_slice(mac)
            .map_err(|_| OpenError::BadMac)?;
        let counter = u64::from_be_bytes(
            body[ENVELOPE_HEADER - 8..ENVELOPE_HEADER]
                .try_into()
                .expect("8 bytes"),
        );
        if !self
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .accept(counter)
        {
            return Err(OpenError::Replayed);
        }
        Ok(&body[ENVELOPE_HEADER..])
    }
}

/// The attachment id and kind byte of a frame shaped like an envelope
/// (nothing verified: use it only to find the session to open it with).
pub fn envelope_header(frame: &[u8]) -> Option<(AttachmentId, u8)> {
    if frame.len() < ENVELOPE_OVERHEAD
        || &frame[..4] != ENVELOPE_MAGIC
        || frame[4] != ENVELOPE_VERSION
    {
        return None;
    }
    let id = frame[6..6 + ATTACHMENT_ID_LEN].try_into().expect("sized");
    Some((id, frame[5]))
}

fn envelope_mac(key: &Proof, bytes: &[u8]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes a key of any length");
    m.update(bytes);
    m
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

    fn pair() -> (Session, Session) {
        let s = secret(7);
        let (c, v) = ([1u8; 16], [2u8; 16]);
        (
            Session::derive(&s, End::Sender, &c, &v, "snd", "rcv"),
            Session::derive(&s, End::Receiver, &c, &v, "snd", "rcv"),
        )
    }

    #[test]
    fn a_sealed_frame_opens_once_at_the_other_end_only() {
        let (snd, rcv) = pair();
        let f = snd.seal(FrameKind::Request, b"hello");
        assert_eq!(
            envelope_header(&f),
            Some(([2u8; 16], FrameKind::Request as u8))
        );
        assert_eq!(rcv.open(FrameKind::Request, &f), Ok(&b"hello"[..]));
        assert_eq!(rcv.open(FrameKind::Request, &f), Err(OpenError::Replayed));
        // Its own frames do not open at the sealing end (keys per direction).
        let g = snd.seal(FrameKind::Request, b"x");
        assert_eq!(snd.open(FrameKind::Request, &g), Err(OpenError::BadMac));
        // Another socket's kind is refused, and does not burn the counter.
        assert_eq!(rcv.open(FrameKind::Done, &g), Err(OpenError::WrongKind));
        assert_eq!(rcv.open(FrameKind::Request, &g), Ok(&b"x"[..]));
        let r = rcv.seal(FrameKind::Reply, b"ok");
        assert_eq!(snd.open(FrameKind::Reply, &r), Ok(&b"ok"[..]));
    }

    #[test]
    fn tampered_truncated_foreign_and_wrong_key_frames_are_refused() {
        let (snd, rcv) = pair();
        let f = snd.seal(FrameKind::Request, b"payload");
        for i in 0..f.len() {
            let mut t = f.clone();
            t[i] ^= 0x01;
            assert!(
                rcv.open(FrameKind::Request, &t).is_err(),
                "byte {i} flipped"
            );
        }
        assert_eq!(
            rcv.open(FrameKind::Request, &f[..f.len() - 1]),
            Err(OpenError::BadMac)
        );
        assert_eq!(
            rcv.open(FrameKind::Request, &f[..ENVELOPE_OVERHEAD - 1]),
            Err(OpenError::NotSealed)
        );
        assert_eq!(
            rcv.open(FrameKind::Request, b"\x81\xa4type"),
            Err(OpenError::NotSealed)
        );
        // Another attachment (other nonces) or another secret.
        let other = Session::derive(&secret(7), End::Sender, &[1; 16], &[3; 16], "snd", "rcv");
        let g = other.seal(FrameKind::Request, b"payload");
        assert_eq!(
            rcv.open(FrameKind::Request, &g),
            Err(OpenError::UnknownAttachment)
        );
        let wrong = Session::derive(&secret(8), End::Sender, &[1; 16], &[2; 16], "snd", "rcv");
        let h = wrong.seal(FrameKind::Request, b"payload");
        assert_eq!(rcv.open(FrameKind::Request, &h), Err(OpenError::BadMac));
        // Node ids are bound too.
        let named = Session::derive(&secret(7), End::Sender, &[1; 16], &[2; 16], "evil", "rcv");
        let k = named.seal(FrameKind::Request, b"payload");
        assert_eq!(rcv.open(FrameKind::Request, &k), Err(OpenError::BadMac));
        // None of that burnt the genuine frame's counter.
        assert_eq!(rcv.open(FrameKind::Request, &f), Ok(&b"payload"[..]));
    }

    #[test]
    fn the_replay_window_takes_late_frames_once_and_refuses_old_ones() {
        let mut w = ReplayWindow::default();
        assert!(!w.accept(0));
        assert!(w.accept(5));
        assert!(w.accept(3), "late but new");
        assert!(!w.accept(3));
        assert!(!w.accept(5));
        assert!(w.accept(5 + 70), "crosses a word");
        assert!(w.accept(4));
        assert!(!w.accept(3), "still remembered after the shift");
        assert!(w.accept(2000));
        assert!(!w.accept(2000 - REPLAY_WINDOW), "too old");
        assert!(w.accept(2000 - REPLAY_WINDOW + 1));
        assert!(!w.accept(2000 - REPLAY_WINDOW + 1));
        for c in 1900..2000 {
            assert!(w.accept(c), "{c}");
        }
        for c in 1900..=2000 {
            assert!(!w.accept(c), "{c} again");
        }
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
