//! ZMQ plumbing with bounded waits: a REQ client that replaces its socket
//! after a timeout (a REQ socket that missed a reply is stuck forever) and
//! whose identity is the route the sender core names, a ROUTER receive /
//! reply pair for the receiver, and a PUSH pool for fire-and-forget signals.

use super::BackendError;
use crossbeam_channel::{Receiver, Sender};
use std::collections::HashMap;
use std::thread::JoinHandle;
use std::time::Duration;

/// How a request failed, as far as delivery is concerned.
#[derive(Debug)]
pub(crate) enum ReqFailure {
    /// The request never left (the peer cannot have seen it).
    NotSent(BackendError),
    /// It left, but no usable reply came (the peer may have acted on it).
    NoReply(BackendError),
}

impl ReqFailure {
    pub(crate) fn into_error(self) -> BackendError {
        match self {
            ReqFailure::NotSent(e) | ReqFailure::NoReply(e) => e,
        }
    }
}

/// A REQ socket to one peer, recreated after any failure or when the
/// route (its identity) changes.
pub(crate) struct ReqClient {
    ctx: zmq::Context,
    url: String,
    timeout: Duration,
    sock: Option<(String, zmq::Socket)>,
}

impl ReqClient {
    pub(crate) fn new(ctx: &zmq::Context, url: &str, timeout: Duration) -> ReqClient {
        ReqClient {
            ctx: ctx.clone(),
            url: url.to_string(),
            timeout,
            sock: None,
        }
    }

    fn socket(&mut self, route: &str) -> Result<&zmq::Socket, BackendError> {
        if self.sock.as_ref().is_some_and(|(r, _)| r != route) {
            self.sock = None;
        }
        if self.sock.is_none() {
            let s = self
                .ctx
                .socket(zmq::REQ)
                .map_err(BackendError::zmq(format!(
                    "creating REQ socket for {}",
                    self.url
                )))?;
            let ms = i32::try_from(self.timeout.as_millis()).unwrap_or(i32::MAX);
            s.set_linger(0).ok();
            s.set_rcvtimeo(ms).ok();
            s.set_sndtimeo(ms).ok();
            s.set_identity(route.as_bytes())
                .map_err(BackendError::zmq(format!(
                    "naming the REQ socket {route:?}"
                )))?;
            s.connect(&self.url)
                .map_err(BackendError::zmq(format!("connecting to {}", self.url)))?;
            self.sock = Some((route.to_string(), s));
        }
        Ok(&self.sock.as_ref().expect("created above").1)
    }

    /// Throws the socket away (the next request makes a new one).
    pub(crate) fn reset(&mut self) {
        self.sock = None;
    }

    /// Sends `frame` from a socket named `route` and waits (bounded) for
    /// one reply frame.
    pub(crate) fn request(
        &mut self,
        route: &str,
        frame: &[u8],
        what: &str,
    ) -> Result<Vec<u8>, ReqFailure> {
        let timeout = self.timeout;
        let url = self.url.clone();
        let sock = self.socket(route).map_err(ReqFailure::NotSent)?;
        if let Err(e) = sock.send(frame, 0) {
            self.sock = None;
            return Err(ReqFailure::NotSent(match e {
                zmq::Error::EAGAIN => BackendError::Timeout {
                    what: format!("{what} to {url}"),
                    after: timeout,
                },
                source => BackendError::Zmq {
                    context: format!("sending {what} to {url}"),
                    source,
                },
            }));
        }
        match sock.recv_bytes(0) {
            Ok(reply) => Ok(reply),
            Err(e) => {
                // The REQ state machine now waits for a reply that may never
                // come: throw the socket away so the next request works.
                self.sock = None;
                Err(ReqFailure::NoReply(match e {
                    zmq::Error::EAGAIN => BackendError::Timeout {
                        what: format!("{what} to {url}"),
                        after: timeout,
                    },
                    source => BackendError::Zmq {
                        context: format!("waiting for the reply to {what} from {url}"),
                        source,
                    },
                }))
            }
        }
    }
}

/// One request read from a ROUTER socket: the requester's identity (its
/// route) and the frame.
pub(crate) struct Routed {
    pub(crate) route: Vec<u8>,
    pub(crate) frame: Vec<u8>,
}

/// What one non-blocking read of a ROUTER socket gave.
pub(crate) enum Received {
    /// Nothing is queued.
    Nothing,
    /// A message that is not a REQ envelope (`[identity, empty, body]`):
    /// dropped, since nobody could read a reply to it.
    Junk,
    /// A request.
    Request(Routed),
}

/// Reads one request from a ROUTER socket that REQ peers talk to, without
/// waiting.
pub(crate) fn router_try_recv(sock: &zmq::Socket) -> Result<Received, zmq::Error> {
    let parts = match sock.recv_multipart(zmq::DONTWAIT) {
        Ok(p) => p,
        Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => return Ok(Received::Nothing),
        Err(e) => return Err(e),
    };
    Ok(match <[Vec<u8>; 3]>::try_from(parts) {
        Ok([route, empty, frame]) if empty.is_empty() => Received::Request(Routed { route, frame }),
        _ => Received::Junk,
    })
}

/// Replies to the REQ peer named `route` on a ROUTER socket.
pub(crate) fn router_reply(
    sock: &zmq::Socket,
    route: &[u8],
    reply: &[u8],
) -> Result<(), zmq::Error> {
    sock.send_multipart([route, &[][..], reply], 0)
}

/// One signal to push: the peer (`host:port`) and the frame.
pub(crate) struct Push {
    pub(crate) url: String,
    pub(crate) frame: Vec<u8>,
}

/// A thread owning one PUSH socket per destination (ZMQ sockets are not
/// thread-safe). A destination that stops reading cannot block the others:
/// sends never wait, and a full queue drops the signal (counted, logged).
pub(crate) struct PushPool {
    tx: Option<Sender<Push>>,
    thread: Option<JoinHandle<()>>,
}

impl PushPool {
    pub(crate) fn spawn(
        ctx: &zmq::Context,
        name: &str,
        on_drop: impl Fn(&str) + Send + 'static,
    ) -> Result<PushPool, BackendError> {
        let (tx, rx) = crossbeam_channel::unbounded::<Push>();
        let ctx = ctx.clone();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || push_loop(ctx, rx, on_drop))
            .map_err(|e| BackendError::Setup(format!("spawning {name}: {e}")))?;
        Ok(PushPool {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Queues `frame` for `url` (`host:port`).
    pub(crate) fn send(&self, url: &str, frame: Vec<u8>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Push {
                url: url.to_string(),
                frame,
            });
        }
    }
}

impl Drop for PushPool {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Most PUSH sockets a pool keeps open; the least recently used is closed
/// to open another (its destination gets a new one when it is sent to again).
pub(crate) const MAX_PUSH_SOCKETS: usize = 256;

/// Values by destination, at most `cap`, least recently used evicted first.
pub(crate) struct Lru<S> {
    cap: usize,
    tick: u64,
    map: HashMap<String, (u64, S)>,
    evicted: u64,
}

impl<S> Lru<S> {
    pub(crate) fn new(cap: usize) -> Lru<S> {
        Lru {
            cap: cap.max(1),
            tick: 0,
            map: HashMap::new(),
            evicted: 0,
        }
    }

    /// The value for `key`, made by `make` (after evicting the least
    /// recently used one when full) if there is none; marks it used.
    pub(crate) fn get_or_try_insert<E>(
        &mut self,
        key: &str,
        make: impl FnOnce() -> Result<S, E>,
    ) -> Result<&S, E> {
        self.tick += 1;
        let tick = self.tick;
        if !self.map.contains_key(key) {
            let made = make()?;
            if self.map.len() >= self.cap {
                let oldest = self
                    .map
                    .iter()
                    .min_by_key(|(_, (used, _))| *used)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    self.map.remove(&k);
                    self.evicted += 1;
                }
            }
            self.map.insert(key.to_string(), (tick, made));
        }
        let entry = self.map.get_mut(key).expect("present");
        entry.0 = tick;
        Ok(&entry.1)
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn evicted(&self) -> u64 {
        self.evicted
    }
}

fn push_loop(ctx: zmq::Context, rx: Receiver<Push>, on_drop: impl Fn(&str)) {
    let mut socks: Lru<zmq::Socket> = Lru::new(MAX_PUSH_SOCKETS);
    for p in rx {
        let made = socks.get_or_try_insert(&p.url, || {
            let s = ctx.socket(zmq::PUSH).map_err(|e| {
                log::warn!("cannot create PUSH socket for {}: {e}", p.url);
            })?;
            // Queued signals get a moment to leave when the pool shuts down
            // (or the socket is evicted); a destination that is gone must
            // not hold that up for long.
            s.set_linger(200).ok();
            s.set_sndhwm(10_000).ok();
            s.connect(&format!("tcp://{}", p.url)).map_err(|e| {
                log::warn!("cannot connect PUSH socket to {}: {e}", p.url);
            })?;
            Ok::<_, ()>(s)
        });
        let Ok(s) = made else {
            on_drop(&p.url);
            continue;
        };
        if let Err(e) = s.send(p.frame, zmq::DONTWAIT) {
            log::warn!("dropping a signal to {}: {e}", p.url);
            on_drop(&p.url);
        }
    }
    if socks.evicted() > 0 {
        log::debug!(
            "PUSH pool closed {} idle socket(s) to stay within {MAX_PUSH_SOCKETS} ({} open at the end)",
            socks.evicted(),
            socks.len()
        );
    }
}

#[cfg(test)]
mod lru_tests {
    use super::*;

    #[test]
    fn the_least_recently_used_destination_is_closed_first_and_the_cap_holds() {
        let mut lru: Lru<u32> = Lru::new(2);
        let mut made = 0;
        let mut get = |lru: &mut Lru<u32>, k: &str| {
            *lru.get_or_try_insert(k, || {
                made += 1;
                Ok::<_, ()>(made)
            })
            .unwrap()
        };
        assert_eq!(get(&mut lru, "a"), 1);
        assert_eq!(get(&mut lru, "b"), 2);
        assert_eq!(get(&mut lru, "a"), 1); // a is now the most recent
        assert_eq!(get(&mut lru, "c"), 3); // b, the least recent, goes
        assert_eq!((lru.len(), lru.evicted()), (2, 1));
        assert_eq!(get(&mut lru, "a"), 1);
        assert_eq!(get(&mut lru, "b"), 4); // b comes back as a new one
        assert_eq!((lru.len(), lru.evicted()), (2, 2));
        // A failed make changes nothing.
        let r = lru.get_or_try_insert("d", || Err::<u32, _>("no"));
        assert_eq!(r.err(), Some("no"));
        assert_eq!(lru.len(), 2);
    }
}
