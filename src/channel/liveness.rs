//! The liveness link of the one-sided device channels (`hccl`, `hixl`):
//! one small TCP connection per peer pair, opened during setup, on which
//! nothing is sent after its hello. Its closing is the signal: the peer's
//! process exited, or it detached after its last batch left the device.
//! Neither HCCL's nor HIXL's one-sided path can tell a dead peer (the
//! emulator's copies even succeed into a dead peer's still-mapped memory),
//! and neither can refuse a peer's access, so this link is what makes a
//! revoked grant quiescent.
//!
//! The connecting side dials the listener the answer named and sends a
//! 16-byte hello (`"APDW"`, a flag byte, 3 pad bytes, the session); with a
//! deployment secret the flag is set and a proof over the session, fresh
//! bytes of the offer and the listener's address follows
//! ([`watch_proof`]), and the listener takes no link without it. The
//! listening side's setup acks a link (one byte) only once it took it, so
//! a side whose setup failed before its link opened knows the peer's end
//! never opened either (and so the peer never went on to reach its
//! memory); a dialler whose ack does not come keeps its end as though
//! open, as the peer may have taken it ([`LinkFailure`]).

use super::{bind_listener, ChannelError};
use crate::auth::{Proof, Secret, Step, PROOF_LEN};
use crossbeam_channel::{Receiver, Sender};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::one_sided::lock;

/// First bytes on a liveness link: magic, a flag byte, 3 pad bytes, the
/// session; with a deployment secret the flag is [`WATCH_PROVEN`] and the
/// proof ([`watch_proof`]) follows. Without one the flag is 0 and nothing
/// follows (the wire of before).
pub(crate) const WATCH_MAGIC: &[u8; 4] = b"APDW";
/// Bytes of a liveness link's hello before its proof.
pub(crate) const WATCH_HELLO: usize = 16;
/// The flag byte of a hello whose proof follows.
pub(crate) const WATCH_PROVEN: u8 = 1;

/// The proof a liveness link's hello carries with a deployment secret: over
/// the session and the offer's fresh bytes (hccl: its root info; hixl:
/// its server address), both exchanged only in the authenticated
/// handshake, and the listener's
/// address as its answer named it. Good for that one link only.
pub(crate) fn watch_proof(secret: &Secret, session: u64, fresh: &[u8], listener: &str) -> Proof {
    secret.prove(
        Step::HcclWatch,
        &[&session.to_le_bytes(), fresh, listener.as_bytes()],
    )
}

/// The opening bytes of a liveness link: the 16-byte hello, and with a
/// deployment secret the flag and the proof.
pub(crate) fn watch_hello(session: u64, proof: Option<&Proof>) -> Vec<u8> {
    let mut hello = vec![0u8; WATCH_HELLO];
    hello[..4].copy_from_slice(WATCH_MAGIC);
    hello[8..].copy_from_slice(&session.to_le_bytes());
    if let Some(p) = proof {
        hello[4] = WATCH_PROVEN;
        hello.extend_from_slice(p);
    }
    hello
}

/// How this side gets its liveness link to a peer.
pub(crate) enum LinkRole {
    /// The connecting side dials the listener the answer named.
    Dial {
        addr: SocketAddr,
        session: u64,
        /// With a deployment secret: the proof the hello carries.
        proof: Option<Proof>,
    },
    /// The listening side: the link arrives through its [`WatchServer`].
    Await(Receiver<TcpStream>),
}

impl LinkRole {
    /// The dialling role for the listener at `watch` (as the peer's
    /// answer named it), proving `fresh` with `secret` when one is set.
    pub(crate) fn dial(
        node: &str,
        watch: &str,
        session: u64,
        fresh: &[u8],
        secret: Option<&Secret>,
    ) -> Result<LinkRole, ChannelError> {
        let addr = std::net::ToSocketAddrs::to_socket_addrs(watch)
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                ChannelError::Handshake(format!("peer {node}: bad liveness address {watch:?}"))
            })?;
        // With a secret the link's hello proves it is ours: nobody else
        // can take the link the peer will trust as our liveness.
        let proof = secret.map(|s| watch_proof(s, session, fresh, watch));
        Ok(LinkRole::Dial {
            addr,
            session,
            proof,
        })
    }

    /// Opens (or waits for) the link by `deadline`.
    pub(crate) fn open(self, deadline: Instant) -> Result<Arc<Watch>, LinkFailure> {
        let stream = match self {
            LinkRole::Dial {
                addr,
                session,
                proof,
            } => dial_watch(addr, session, proof, deadline).map_err(|(message, sent)| {
                LinkFailure {
                    message,
                    // The hello went out: the peer may have taken the link
                    // (and gone on) though its ack never reached us.
                    maybe_open: sent.and_then(|s| Watch::new(s).ok()).map(Arc::new),
                }
            })?,
            LinkRole::Await(rx) => take_link(&rx, deadline).map_err(|message| LinkFailure {
                message,
                maybe_open: None,
            })?,
        };
        Watch::new(stream)
            .map(Arc::new)
            .map_err(|message| LinkFailure {
                message,
                maybe_open: None,
            })
    }
}

/// A liveness link that did not open.
pub(crate) struct LinkFailure {
    /// Why.
    pub(crate) message: String,
    /// Our end, when the peer may have opened its own anyway (the hello
    /// reached its listener, the ack did not reach us): its closing proves
    /// the peer gone. `None`: the peer's end cannot have opened.
    pub(crate) maybe_open: Option<Arc<Watch>>,
}

/// Waits (until `deadline`) for the link the listener routes to this
/// setup, then acks it: the dialler's end opens only now, so a link this
/// setup never took never opens at the peer either.
pub(crate) fn take_link(rx: &Receiver<TcpStream>, deadline: Instant) -> Result<TcpStream, String> {
    let left = deadline.saturating_duration_since(Instant::now());
    let mut s = rx
        .recv_timeout(left)
        .map_err(|_| format!("the peer did not open its liveness link within {left:?}"))?;
    s.write_all(&[1])
        .map_err(|e| format!("acknowledging the peer's liveness link: {e}"))?;
    Ok(s)
}

/// Opens the liveness link of `session` to the listener at `addr` (with
/// `proof`, when a deployment secret is set) and waits for its ack. On an
/// error after the hello was sent, the stream comes back with it: the
/// peer may have taken the link.
pub(crate) fn dial_watch(
    addr: SocketAddr,
    session: u64,
    proof: Option<Proof>,
    deadline: Instant,
) -> Result<TcpStream, (String, Option<TcpStream>)> {
    let left = deadline.saturating_duration_since(Instant::now());
    let io = |e: io::Error| format!("liveness link to {addr}: {e}");
    let mut s = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)))
        .map_err(|e| (io(e), None))?;
    if let Err(e) = s.set_read_timeout(Some(left.max(Duration::from_millis(1)))) {
        return Err((io(e), None));
    }
    // Partly written, the hello may still have reached the listener whole.
    if let Err(e) = s.write_all(&watch_hello(session, proof.as_ref())) {
        return Err((io(e), Some(s)));
    }
    let mut ack = [0u8; 1];
    if let Err(e) = s.read_exact(&mut ack) {
        let why = if proof.is_some() {
            " (or did not take its proof: is its pd_auth_secret_file the same?)"
        } else {
            ""
        };
        return Err((
            format!("the peer refused the liveness link for this session{why}: {e}"),
            Some(s),
        ));
    }
    Ok(s)
}

/// The liveness link to one peer. Nothing is sent on it after the opening
/// bytes; its closing (EOF or error) is the signal.
pub(crate) struct Watch {
    stream: TcpStream,
    /// The first terminal answer the socket gave. The kernel reports a
    /// socket error once and then reads as EOF, so a keepalive timeout
    /// (no proof) would look like a clean close (proof) on the next look:
    /// the first answer is kept and every later question gets it.
    end: std::sync::Mutex<Option<LinkEnd>>,
}

/// How a liveness link ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LinkEnd {
    /// EOF: the peer closed it (its process exited or detached).
    Closed,
    /// Reset by the peer's host: its process is gone.
    Reset(String),
    /// Anything else (a keepalive timeout in a partition): no proof the
    /// peer stopped.
    Failed(String),
}

impl Watch {
    pub(crate) fn new(stream: TcpStream) -> Result<Watch, String> {
        set_keepalive(&stream);
        stream
            .set_nonblocking(true)
            .map_err(|e| format!("liveness link: {e}"))?;
        Ok(Watch {
            stream,
            end: std::sync::Mutex::new(None),
        })
    }

    /// How the link ended, if it has; the first answer is remembered.
    pub(crate) fn end(&self) -> Option<LinkEnd> {
        let mut end = self.end.lock().unwrap_or_else(|e| e.into_inner());
        if end.is_none() {
            // Nothing is sent after the opening bytes but an ack that came
            // late (a dialler that stopped waiting for it): read and
            // dropped, so the close behind it is seen.
            let mut b = [0u8; 16];
            *end = match (&self.stream).read(&mut b) {
                Ok(0) => Some(LinkEnd::Closed),
                Ok(_) => None,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => None,
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                    Some(LinkEnd::Reset(e.to_string()))
                }
                Err(e) => Some(LinkEnd::Failed(e.to_string())),
            };
        }
        end.clone()
    }

    /// `Err` with what was seen once the peer closed the link or it broke.
    pub(crate) fn check(&self) -> Result<(), String> {
        match self.end() {
            None => Ok(()),
            Some(LinkEnd::Closed) => {
                Err("its liveness link closed (the process exited or detached)".into())
            }
            Some(LinkEnd::Reset(e) | LinkEnd::Failed(e)) => {
                Err(format!("its liveness link failed: {e}"))
            }
        }
    }

    /// Whether the peer closed its end, or its process is gone (reset):
    /// it can no longer touch our memory (see the module docs). A link
    /// that merely failed (a keepalive timeout in a network partition) is
    /// no such proof, now or on any later look: HCCL traffic may take
    /// another network, so its DMA may still be queued.
    pub(crate) fn peer_closed(&self) -> bool {
        matches!(self.end(), Some(LinkEnd::Closed | LinkEnd::Reset(_)))
    }

    /// Closes our end for writing: the peer sees EOF, and we keep reading
    /// its end to learn when it closes too.
    pub(crate) fn close(&self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }
}

/// Keepalive so a peer host that vanishes without closing is noticed too.
fn set_keepalive(s: &TcpStream) {
    let fd = s.as_raw_fd();
    let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| {
        // SAFETY: setsockopt on a socket we own, reading one c_int whose
        // size we pass; failure only leaves the default in place.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 5);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 2);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
}

/// Accepts liveness links and hands each to the setup waiting for its session.
pub(crate) struct WatchServer {
    stop: Arc<AtomicBool>,
    pub(crate) addr: SocketAddr,
    pub(crate) shared: Arc<WatchShared>,
    accept: Option<JoinHandle<()>>,
}

/// What the liveness listener's threads share.
pub(crate) struct WatchShared {
    /// The listener's address as endpoints name it (a proof covers it).
    addr: String,
    /// The setups waiting for their link, by session.
    waiting: Mutex<HashMap<u64, Waiting>>,
    /// Hellos for a waiting session that carried no valid proof of the
    /// deployment secret (refused; the session stays for the genuine one).
    pub(crate) unproven: AtomicU64,
    /// The channel whose links these are (for logs).
    channel: &'static str,
}

/// A setup waiting for its liveness link.
struct Waiting {
    tx: Sender<TcpStream>,
    /// With a deployment secret: the secret and the offer's fresh bytes
    /// (hccl: its root info), which the hello must prove (see [`watch_proof`]).
    proof: Option<(Secret, Vec<u8>)>,
}

impl WatchServer {
    /// The listener's address as peers dial it (what endpoints carry).
    pub(crate) fn advertised(&self) -> &str {
        &self.shared.addr
    }

    /// Listens where `at` says for the liveness links of the `channel`
    /// channel (named in logs).
    pub(crate) fn bind(
        at: &super::ListenAt,
        channel: &'static str,
    ) -> Result<WatchServer, ChannelError> {
        let (listener, addr, advertised) =
            bind_listener(at, &format!("{channel} liveness listener"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(WatchShared {
            addr: advertised,
            waiting: Mutex::default(),
            unproven: AtomicU64::new(0),
            channel,
        });
        let (stop2, shared2) = (Arc::clone(&stop), Arc::clone(&shared));
        let accept = std::thread::Builder::new()
            .name(format!("pd-{channel}-watch"))
            .spawn(move || {
                // Hellos are read off this thread, each by its deadline: a
                // connection that says nothing holds up no other.
                let reading = Arc::new(AtomicUsize::new(0));
                for s in listener.incoming() {
                    if stop2.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(s) = s else { continue };
                    if reading.fetch_add(1, Ordering::AcqRel) >= MAX_WATCH_HELLOS {
                        // Closing refuses it; the dialer's setup reports it.
                        reading.fetch_sub(1, Ordering::AcqRel);
                        log::warn!(
                            "{channel} liveness listener: {MAX_WATCH_HELLOS} connections are \
                             still to say their hello; refused another"
                        );
                        continue;
                    }
                    let (shared, reading2) = (Arc::clone(&shared2), Arc::clone(&reading));
                    let spawned = std::thread::Builder::new()
                        .name(format!("pd-{channel}-hello"))
                        .spawn(move || {
                            route_watch(s, &shared);
                            reading2.fetch_sub(1, Ordering::AcqRel);
                        });
                    if spawned.is_err() {
                        reading.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            })
            .map_err(|source| ChannelError::Io {
                context: "spawning the liveness listener thread".into(),
                source,
            })?;
        Ok(WatchServer {
            stop,
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// Where the link for `session` will be delivered; with `proof` (the
    /// secret and the offer's root info) only to a hello that proves it.
    pub(crate) fn expect(
        &self,
        session: u64,
        proof: Option<(Secret, Vec<u8>)>,
    ) -> Receiver<TcpStream> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        lock(&self.shared.waiting).insert(session, Waiting { tx, proof });
        rx
    }
}

/// Most liveness-link hellos read at once (a thread each, for at most
/// [`WATCH_HELLO_TIMEOUT`]); connections beyond are closed.
const MAX_WATCH_HELLOS: usize = 128;
/// How long a liveness link may take, in all, to send its hello.
const WATCH_HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Fills `buf` from `s` by `deadline`, however the bytes trickle in.
fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads a liveness link's hello and hands the link to the setup waiting
/// for its session. Closing it (every refusal) tells the dialer it was
/// refused. With a deployment secret, a hello without a valid proof is
/// refused and counted, and leaves the session waiting for the genuine one:
/// whoever learnt the session cannot take the link whose closing is proof
/// that the peer stopped.
fn route_watch(mut s: TcpStream, shared: &WatchShared) {
    let deadline = Instant::now() + WATCH_HELLO_TIMEOUT;
    let mut hello = [0u8; WATCH_HELLO];
    if read_by(&mut s, &mut hello, deadline).is_err() || &hello[..4] != WATCH_MAGIC {
        return;
    }
    let session = u64::from_le_bytes(hello[8..].try_into().expect("8 bytes"));
    // Looked at, not taken: the session is taken only by a proven hello.
    let wants = match lock(&shared.waiting).get(&session) {
        Some(w) => w.proof.clone(),
        None => return,
    };
    if let Some((secret, fresh)) = wants {
        let mut proof = [0u8; PROOF_LEN];
        let proven = hello[4] == WATCH_PROVEN
            && read_by(&mut s, &mut proof, deadline).is_ok()
            && secret.verify(
                Step::HcclWatch,
                &[&session.to_le_bytes(), &fresh, shared.addr.as_bytes()],
                &proof,
            );
        if !proven {
            let from = s
                .peer_addr()
                .map_or_else(|_| "?".to_string(), |a| a.to_string());
            if shared.unproven.fetch_add(1, Ordering::Relaxed) == 0 {
                log::warn!(
                    "{} liveness listener: refused a link from {from} for a waiting session \
                     that did not prove the deployment secret (counted in \
                     grants.unauthenticated; logged once)",
                    shared.channel
                );
            } else {
                log::debug!(
                    "{} liveness listener: refused an unproven link from {from}",
                    shared.channel
                );
            }
            return;
        }
    }
    let Some(w) = lock(&shared.waiting).remove(&session) else {
        // Taken meanwhile by another proven hello.
        return;
    };
    // The setup acks it once it took it (`take_link`); a setup that gave
    // up drops it unacked, refusing it.
    let _ = w.tx.send(s);
}

impl Drop for WatchServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod watch_tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (Watch, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (theirs, _) = l.accept().unwrap();
        (Watch::new(ours).unwrap(), theirs)
    }

    /// Issue 25 item 8: the listener read each hello on its accept thread,
    /// for up to 5 s per connection, so connections that said nothing
    /// held up every good peer's liveness link behind them (ten of them:
    /// 50 s, past any setup). Hellos are now read off the accept thread.
    #[test]
    fn a_good_peers_hello_is_accepted_while_silent_connections_are_open() {
        let server =
            WatchServer::bind(&crate::channel::ListenAt::any("127.0.0.1"), "test").unwrap();
        let delivered = server.expect(41, None);
        let silent: Vec<TcpStream> = (0..10)
            .map(|_| TcpStream::connect(server.addr).unwrap())
            .collect();
        let taker = std::thread::spawn(move || {
            take_link(&delivered, Instant::now() + Duration::from_secs(20))
                .expect("its link is handed to the setup waiting for it")
        });
        let ours = dial_watch(
            server.addr,
            41,
            None,
            Instant::now() + Duration::from_secs(20),
        )
        .expect("the good peer's hello is accepted");
        let theirs = taker.join().unwrap();
        assert_eq!(ours.local_addr().unwrap(), theirs.peer_addr().unwrap());
        // A wrong session is still refused (closed without the ack).
        let (e, _) = dial_watch(
            server.addr,
            42,
            None,
            Instant::now() + Duration::from_secs(20),
        )
        .unwrap_err();
        assert!(e.contains("refused"), "{e}");
        drop(silent);
    }

    /// Issue 25: anyone who saw a session in the handshake could open its
    /// liveness link first; the link was then theirs, and their closing it
    /// was taken as proof the peer stopped (its pages freed while it might
    /// still write). With a secret, hellos without a valid proof are
    /// refused and counted, and the session stays for the genuine one.
    #[test]
    fn with_a_secret_forged_liveness_hellos_are_refused_and_the_genuine_one_attached() {
        let secret = Secret::from_bytes(&[7; 32]).unwrap();
        let other = Secret::from_bytes(&[8; 32]).unwrap();
        let root_info = vec![0x5a; 64];
        let server =
            WatchServer::bind(&crate::channel::ListenAt::any("127.0.0.1"), "test").unwrap();
        let listener = server.addr.to_string();
        let session = 0x1234_5678_9abc_def0;
        let delivered = server.expect(session, Some((secret.clone(), root_info.clone())));
        let deadline = || Instant::now() + Duration::from_secs(20);
        let forged = |bytes: Vec<u8>| {
            let mut s = TcpStream::connect(server.addr).unwrap();
            s.write_all(&bytes).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut ack = [0u8; 1];
            // Closed without the ack: refused.
            assert_eq!(s.read(&mut ack).unwrap(), 0, "a forged hello was taken");
        };
        // The right session and no proof (the wire without a secret).
        forged(watch_hello(session, None));
        // A proof under another secret, or for another session or root info.
        let wrong = [
            watch_proof(&other, session, &root_info, &listener),
            watch_proof(&secret, session + 1, &root_info, &listener),
            watch_proof(&secret, session, &[0x5b; 64], &listener),
            watch_proof(&secret, session, &root_info, "127.0.0.1:1"),
        ];
        for p in &wrong {
            forged(watch_hello(session, Some(p)));
        }
        // The right flag and a truncated proof, then EOF.
        let mut short = watch_hello(session, Some(&wrong[0]));
        short.truncate(WATCH_HELLO + 8);
        let mut s = TcpStream::connect(server.addr).unwrap();
        s.write_all(&short).unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        assert_eq!(s.read(&mut [0u8; 1]).unwrap(), 0);
        assert_eq!(server.shared.unproven.load(Ordering::Relaxed), 6);
        assert!(delivered.try_recv().is_err(), "nothing was attached");
        // The genuine hello still finds its session.
        let proof = watch_proof(&secret, session, &root_info, &listener);
        let taker = std::thread::spawn(move || {
            take_link(&delivered, deadline()).expect("its link is handed to the setup")
        });
        let ours = dial_watch(server.addr, session, Some(proof), deadline())
            .expect("the genuine hello is accepted");
        let theirs = taker.join().unwrap();
        assert_eq!(ours.local_addr().unwrap(), theirs.peer_addr().unwrap());
        assert_eq!(server.shared.unproven.load(Ordering::Relaxed), 6);
        // Once taken, the session is gone: a replay of that very hello is refused.
        let (e, _) = dial_watch(server.addr, session, Some(proof), deadline()).unwrap_err();
        assert!(
            e.contains("refused") && e.contains("pd_auth_secret_file"),
            "{e}"
        );
    }

    /// Issue "device error paths": the listener acked a link before the
    /// setup waiting for it took it, so a link whose setup had given up
    /// (timed out) was acked anyway: the dialer took it as open and its
    /// side went on to reach our memory, while ours had failed before its
    /// link opened and took that as proof the peer never could. The ack now
    /// comes from the setup that took the link: one it never took is
    /// refused.
    #[test]
    fn a_link_whose_setup_gave_up_is_refused_not_acked() {
        let server =
            WatchServer::bind(&crate::channel::ListenAt::any("127.0.0.1"), "test").unwrap();
        drop(server.expect(43, None));
        let (e, sent) = dial_watch(
            server.addr,
            43,
            None,
            Instant::now() + Duration::from_secs(20),
        )
        .unwrap_err();
        assert!(e.contains("refused"), "{e}");
        // The hello went out, so the end is kept; the refusal closed it.
        let w = Watch::new(sent.expect("the stream")).unwrap();
        assert!(closes_within(&w, Duration::from_secs(10)));
    }

    fn closes_within(w: &Watch, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        while !w.peer_closed() {
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    /// A dialler whose ack does not come in time cannot tell whether the
    /// peer took the link: it keeps its end, which proves the peer gone
    /// only once the peer closes it, even after a late ack.
    #[test]
    fn a_dial_whose_ack_never_came_keeps_its_end_until_the_peer_closes() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let role = LinkRole::Dial {
            addr,
            session: 44,
            proof: None,
        };
        let dialler =
            std::thread::spawn(move || role.open(Instant::now() + Duration::from_millis(300)));
        let (mut theirs, _) = l.accept().unwrap();
        let mut hello = [0u8; WATCH_HELLO];
        theirs.read_exact(&mut hello).unwrap();
        let Err(f) = dialler.join().unwrap() else {
            panic!("opened without an ack");
        };
        assert!(f.message.contains("refused"), "{}", f.message);
        let w = f
            .maybe_open
            .expect("kept: the peer may have taken the link");
        // The ack comes late; the peer still holds its end.
        theirs.write_all(&[1]).unwrap();
        assert!(!closes_within(&w, Duration::from_millis(200)));
        drop(theirs);
        assert!(closes_within(&w, Duration::from_secs(10)));
    }

    #[test]
    fn a_clean_close_is_proof_and_stays_so() {
        let (w, theirs) = pair();
        assert!(w.check().is_ok() && !w.peer_closed());
        drop(theirs);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !w.peer_closed() {
            assert!(Instant::now() < deadline, "EOF never seen");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(w.check().unwrap_err().contains("closed"));
        assert!(w.peer_closed());
    }

    /// The kernel reports a keepalive timeout once, then reads EOF; the
    /// first answer (no proof) must stand, or a partitioned writer's pages
    /// would be freed on the next sweep.
    #[test]
    fn a_failed_link_never_turns_into_proof_on_a_later_look() {
        let (w, theirs) = pair();
        *w.end.lock().unwrap() = Some(LinkEnd::Failed("Connection timed out".into()));
        drop(theirs);
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..3 {
            assert!(!w.peer_closed());
            assert!(w.check().unwrap_err().contains("timed out"));
        }
    }
}
