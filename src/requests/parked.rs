//! Router-native flow, prefill side: saves submitted without a receiver
//! ([`SaveQueue::submit_parked`]) are gathered into the sender's pages (the
//! engine's blocks go back at once, as for every save) and parked until a
//! decode registers for them on this rank's registration port.
//!
//! The decisions (park, match a registration, expire) are the sans-IO
//! [`ParkingLot`]'s; this shell owns the registration socket (a ROUTER on
//! `pd_register_port[rank]`), one thread that answers registrations and
//! expires transfers, and one that sends attached transfers (so a slow
//! decode never holds up the answers to others).

use super::{Piece, SaveJob, Saved, State};
use crate::backend::register::{open_request, seal_answer, Refused};
use crate::backend::{lock, BackendError, Sender, TransferSpec};
use crate::config::{PortList, MAX_HOST_BYTES};
use crate::protocol::parking::{Ended, ParkingLot, Registered};
use crate::protocol::{ParkingCounters, RegisterDecode, RegisterDecodeAck};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A parked save: its pieces, gathered.
pub(super) struct Parked {
    pieces: Vec<Piece>,
}

/// The lot of one prefill rank.
pub(super) type Lot = ParkingLot<Parked, RegisterDecode>;

/// Counters of the registration port (besides the lot's).
#[derive(Default)]
struct PortCounters {
    forged: AtomicU64,
    replayed: AtomicU64,
    malformed: AtomicU64,
    chunks_sent: AtomicU64,
    chunks_skipped: AtomicU64,
}

/// Registration counters of a save queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegistrationStats {
    /// The parking lot's counters.
    pub parking: ParkingCounters,
    /// Registrations dropped because their seal did not verify.
    pub forged: u64,
    /// Registrations dropped because their nonce was seen before.
    pub replayed: u64,
    /// Registrations answered with an error because they did not decode
    /// or named an unusable receiver.
    pub malformed: u64,
    /// Chunk pieces of attached transfers sent to their decode.
    pub chunks_sent: u64,
    /// Chunk pieces not sent because the decode held them already.
    pub chunks_skipped: u64,
}

/// What the two threads share with the queue.
pub(super) struct Parking {
    pub(super) lot: Mutex<Lot>,
    port: u16,
    counters: PortCounters,
    stop: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// A transfer a registration attached, for the send thread.
struct Attach {
    id: String,
    parked: Parked,
    to: RegisterDecode,
}

/// How many registration nonces are remembered (replay check).
const NONCES: usize = 65536;

impl Parking {
    /// Binds this rank's registration port and starts the threads.
    pub(super) fn start(
        sender: &Arc<Sender>,
        rank: usize,
        state: Arc<State<SaveJob>>,
        saved: Arc<Mutex<VecDeque<(String, Saved)>>>,
        cancels: crossbeam_channel::Sender<(String, Saved)>,
    ) -> Result<Arc<Parking>, BackendError> {
        let config = sender.config();
        let (secret, host) = crate::backend::register::secret_and_host(config)?;
        let ctx = zmq::Context::new();
        let sock = ctx
            .socket(zmq::ROUTER)
            .map_err(|e| BackendError::Setup(format!("creating the registration socket: {e}")))?;
        sock.set_linger(0).ok();
        let want = config.register_port(rank);
        let bind = match want {
            0 => {
                let url = crate::backend::bind_url(config, &host, 0);
                format!("{}*", url.strip_suffix('0').unwrap_or(&url))
            }
            p => crate::backend::bind_url(config, &host, p),
        };
        sock.bind(&bind).map_err(|e| {
            BackendError::Setup(format!(
                "pd_register_port: cannot listen for decode registrations on {bind}: {e} (free \
                 the port, or set pd_register_port to a free one per TP rank)"
            ))
        })?;
        let port = bound_port(&sock).ok_or_else(|| {
            BackendError::Setup("the registration socket reports no bound port".into())
        })?;
        let parking = Arc::new(Parking {
            lot: Mutex::new(ParkingLot::new(config.park_timeout)),
            port,
            counters: PortCounters::default(),
            stop: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
        });
        let (tx, rx) = crossbeam_channel::unbounded::<Attach>();
        let listen = {
            let (parking, sender, state) =
                (Arc::clone(&parking), Arc::clone(sender), Arc::clone(&state));
            crate::backend::spawn(&format!("apd-register-{rank}"), move || {
                parking.listen(&sock, secret.as_ref(), &sender, &state, &tx)
            })?
        };
        let send = {
            let (parking, sender) = (Arc::clone(&parking), Arc::clone(sender));
            crate::backend::spawn(&format!("apd-attach-{rank}"), move || {
                for a in rx {
                    let r = send_attached(&sender, &parking, &a.id, a.parked, &a.to);
                    parking.end(&state, &saved, &cancels, &a.id, r);
                }
            })?
        };
        lock(&parking.threads).extend([listen, send]);
        log::info!(
            "rank {rank}: taking decode registrations for parked transfers on {host}:{port}"
        );
        Ok(parking)
    }

    /// The port registrations come to.
    pub(super) fn port(&self) -> u16 {
        self.port
    }

    pub(super) fn stats(&self) -> RegistrationStats {
        RegistrationStats {
            parking: lock(&self.lot).counters(),
            forged: self.counters.forged.load(Ordering::Relaxed),
            replayed: self.counters.replayed.load(Ordering::Relaxed),
            malformed: self.counters.malformed.load(Ordering::Relaxed),
            chunks_sent: self.counters.chunks_sent.load(Ordering::Relaxed),
            chunks_skipped: self.counters.chunks_skipped.load(Ordering::Relaxed),
        }
    }

    /// A parked save's gather ended: park it, or hand it back with the
    /// decode that registered meanwhile (the worker sends it now).
    pub(super) fn park(&self, id: &str, pieces: Vec<Piece>) -> Result<ParkOutcome, String> {
        let verdict = lock(&self.lot).park(id, Parked { pieces }, Instant::now());
        match verdict {
            Ok(None) => Ok(ParkOutcome::Parked),
            Ok(Some((parked, to))) => Ok(ParkOutcome::SendNow(parked, to)),
            Err(parked) => {
                drop(parked);
                Err(format!(
                    "transfer {id:?} was cancelled, or no decode registered within \
                     pd_park_timeout, while it was still being gathered: nothing was sent"
                ))
            }
        }
    }
}

/// What [`Parking::park`] did.
pub(super) enum ParkOutcome {
    /// Parked until a decode registers or it expires.
    Parked,
    /// A decode registered during the gather: send it there now.
    SendNow(Parked, RegisterDecode),
}

/// The port a socket bound to (`tcp://host:port`).
fn bound_port(sock: &zmq::Socket) -> Option<u16> {
    let ep = sock.get_last_endpoint().ok()?.ok()?;
    ep.rsplit(':').next()?.parse().ok()
}

/// Sends an attached transfer to the receiver its registration names,
/// skipping the chunks the decode already holds. The spec it went under.
pub(super) fn send_attached(
    sender: &Sender,
    parking: &Parking,
    id: &str,
    parked: Parked,
    to: &RegisterDecode,
) -> Result<(Vec<String>, TransferSpec), String> {
    let ports = |v: &[u64]| PortList::PerRank(v.iter().map(|&p| p as u16).collect());
    let spec = TransferSpec {
        req_id: id.to_string(),
        receiver_host: to.receiver_host.clone(),
        receiver_init_port: ports(&to.receiver_init_port),
        receiver_alloc_port: ports(&to.receiver_alloc_port),
        is_last_prefill: false,
        receiver_rank: None,
    };
    let chunk = sender.chunk_layout().tokens;
    let skip = usize::try_from(to.held_tokens).unwrap_or(usize::MAX) / chunk;
    let mut skipped = 0;
    let pieces: Vec<Piece> = parked
        .pieces
        .into_iter()
        .map(|(route, k, pages)| {
            let n = skip.min(k.len());
            skipped += n;
            // The skipped chunks' pages go back to the pool here.
            let (k, pages) = (k[n..].to_vec(), pages.into_iter().skip(n).collect());
            (route, k, pages)
        })
        .collect();
    if skip > 0 {
        log::debug!("transfer {id:?}: the decode holds its first {skip} chunk(s); not sent");
    }
    let sent: usize = pieces.iter().map(|(_, k, _)| k.len()).sum();
    let c = &parking.counters;
    c.chunks_sent.fetch_add(sent as u64, Ordering::Relaxed);
    c.chunks_skipped
        .fetch_add(skipped as u64, Ordering::Relaxed);
    // Every piece carries the same keys (its heads of each chunk).
    let keys = pieces
        .first()
        .map(|(_, k, _)| k.clone())
        .unwrap_or_default();
    super::put_pieces(sender, pieces, &spec)?;
    Ok((keys, spec))
}

impl Parking {
    /// Ends parked save `id` with `r`; a save cancelled meanwhile tells
    /// its receiver to drop what it got.
    fn end(
        &self,
        state: &State<SaveJob>,
        saved: &Mutex<VecDeque<(String, Saved)>>,
        cancels: &crossbeam_channel::Sender<(String, Saved)>,
        id: &str,
        r: Result<(Vec<String>, TransferSpec), String>,
    ) {
        if let Err(e) = &r {
            log::warn!("parked save {id:?} failed: {e}");
        }
        let what = r.as_ref().ok().cloned();
        if let Some(w) = &what {
            let mut s = lock(saved);
            s.push_back((id.to_string(), w.clone()));
            if s.len() > super::SAVED_MEMORY {
                s.pop_front();
            }
        }
        let cancelled = lock(&state.book).finish(id, r.map(|_| ()));
        if cancelled {
            if let Some(w) = what {
                let mut s = lock(saved);
                if let Some(i) = s.iter().position(|(k, _)| k == id) {
                    s.remove(i);
                }
                drop(s);
                let _ = cancels.send((id.to_string(), w));
            }
        }
    }

    /// The registration thread: answers registrations, expires transfers.
    fn listen(
        &self,
        sock: &zmq::Socket,
        secret: Option<&crate::auth::Secret>,
        sender: &Sender,
        state: &State<SaveJob>,
        attach: &crossbeam_channel::Sender<Attach>,
    ) {
        let mut nonces: crate::protocol::recent::RecentIds<()> =
            crate::protocol::recent::RecentIds::new(NONCES, Duration::from_secs(3600));
        while !self.stop.load(Ordering::Acquire) {
            let now = Instant::now();
            // Taken out of the lot first: its lock is not held below.
            let (expired, timeout) = {
                let mut lot = lock(&self.lot);
                (lot.expire(now), lot.timeout())
            };
            for (id, parked) in expired {
                if let Some(parked) = parked {
                    drop(parked);
                    log::warn!(
                        "transfer {id:?}: no decode registered within pd_park_timeout \
                         ({timeout:?}); its pages are freed (is the router sending the decode \
                         request, with the prefill's kv_transfer_params unchanged?)"
                    );
                    let _ = lock(&state.book).finish(
                        &id,
                        Err(format!(
                            "no decode registered for it within pd_park_timeout ({timeout:?}): \
                             its pages were freed"
                        )),
                    );
                }
            }
            match sock.poll(zmq::POLLIN, 100) {
                Ok(n) if n > 0 => {}
                _ => continue,
            }
            let routed = match crate::backend::zmq_io::router_try_recv(sock) {
                Ok(crate::backend::zmq_io::Received::Request(r)) => r,
                Ok(_) => continue,
                Err(e) => {
                    log::warn!("registration socket: {e}");
                    continue;
                }
            };
            let opened = open_request(secret, &routed.frame, |n| {
                let key = crate::auth::hex(n);
                let seen = nonces.get(&key, now).is_some();
                nonces.insert(&key, (), now);
                seen
            });
            let (msg, nonce) = match opened {
                Ok(m) => m,
                Err(Refused::Forged) => {
                    self.counters.forged.fetch_add(1, Ordering::Relaxed);
                    log::warn!(
                        "dropped a decode registration whose seal does not verify (a peer \
                         without this deployment's pd_auth_secret_file, or a forgery)"
                    );
                    continue;
                }
                Err(Refused::Replayed) => {
                    self.counters.replayed.fetch_add(1, Ordering::Relaxed);
                    log::warn!("dropped a replayed decode registration");
                    continue;
                }
                Err(Refused::Malformed(e)) => {
                    self.counters.malformed.fetch_add(1, Ordering::Relaxed);
                    let ack = refuse(format!("the registration is malformed: {e}"));
                    let _ = crate::backend::zmq_io::router_reply(
                        sock,
                        &routed.route,
                        &seal_answer(secret, None, &ack),
                    );
                    continue;
                }
            };
            let ack = self.decide(sender, msg, now, attach);
            let frame = seal_answer(secret, nonce.as_ref(), &ack);
            if let Err(e) = crate::backend::zmq_io::router_reply(sock, &routed.route, &frame) {
                log::warn!("answering a decode registration: {e}");
            }
        }
    }

    /// The answer to registration `msg`; an attached transfer goes to the
    /// send thread.
    fn decide(
        &self,
        sender: &Sender,
        msg: RegisterDecode,
        now: Instant,
        attach: &crossbeam_channel::Sender<Attach>,
    ) -> RegisterDecodeAck {
        if let Err(why) = check(sender, &msg) {
            self.counters.malformed.fetch_add(1, Ordering::Relaxed);
            return refuse(why);
        }
        let id = msg.transfer_id.clone();
        let verdict = lock(&self.lot).register(&id, msg, now);
        match verdict {
            Registered::Attach(parked, to) => {
                let _ = attach.send(Attach {
                    id: id.clone(),
                    parked,
                    to,
                });
                accept()
            }
            Registered::Held | Registered::AlreadyTaken => accept(),
            Registered::Ended(Ended::Expired) => refuse(format!(
                "transfer {id:?} expired on the prefill: no decode registered within \
                 pd_park_timeout ({:?}); raise pd_park_timeout on the prefill if decodes \
                 queue requests longer",
                lock(&self.lot).timeout()
            )),
            Registered::Ended(e) => refuse(format!(
                "transfer {id:?} ended on the prefill before this registration ({e:?})"
            )),
            Registered::Unknown => refuse(format!(
                "the prefill knows no transfer {id:?} (it restarted, or the decode request \
                 carries another prefill's kv_transfer_params)"
            )),
        }
    }

    /// Stops the threads; parked saves end as failed.
    pub(super) fn shutdown(&self, state: &State<SaveJob>) {
        self.stop.store(true, Ordering::Release);
        for t in lock(&self.threads).drain(..) {
            let _ = t.join();
        }
        let far = Instant::now() + Duration::from_secs(365 * 24 * 3600);
        let left = lock(&self.lot).expire(far);
        for (id, parked) in left {
            if parked.is_some() {
                let _ = lock(&state.book).finish(
                    &id,
                    Err("the sender closed before a decode registered for it".into()),
                );
            }
        }
    }
}

fn accept() -> RegisterDecodeAck {
    RegisterDecodeAck {
        accepted: true,
        error: String::new(),
    }
}

fn refuse(error: String) -> RegisterDecodeAck {
    RegisterDecodeAck {
        accepted: false,
        error,
    }
}

/// Checks a registration's receiver against this sender.
fn check(sender: &Sender, m: &RegisterDecode) -> Result<(), String> {
    if m.transfer_id.is_empty() {
        return Err("the registration names no transfer_id".into());
    }
    if m.receiver_host.is_empty() || m.receiver_host.len() > MAX_HOST_BYTES {
        return Err(format!(
            "receiver_host is {} bytes; it must be 1 to {MAX_HOST_BYTES} (set pd_peer_host on \
             the decode)",
            m.receiver_host.len()
        ));
    }
    let (init, alloc) = (&m.receiver_init_port, &m.receiver_alloc_port);
    if init.is_empty() || init.len() != alloc.len() {
        return Err(format!(
            "the registration lists {} receiver_init_port(s) and {} receiver_alloc_port(s): \
             one of each per decode TP rank",
            init.len(),
            alloc.len()
        ));
    }
    if let Some(p) = init.iter().chain(alloc).find(|&&p| p == 0 || p > 65535) {
        return Err(format!(
            "the registration names port {p}: ports are 1 to 65535"
        ));
    }
    let want = sender.config().peer_tp();
    if init.len() != want {
        return Err(format!(
            "the decode registered {} receiver rank(s) but this prefill's pd_peer_tp_size is \
             {want}: set pd_peer_tp_size on the prefill to the decode's TP size",
            init.len()
        ));
    }
    Ok(())
}
