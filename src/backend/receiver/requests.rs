//! The receiver's request socket: a ROUTER on `pd_peer_alloc_port` that
//! LMCache-style REQ senders talk to. The requester's identity is its
//! route, which names the writer of a push. Each frame is an
//! `AllocRequest`, a `PullReadyNotif` or one of our push notices; the core
//! decides the answer, this loop allocates pages (outside the core's lock),
//! grants them on the channel, replies, and starts pull-eager reads.
//!
//! The loop never waits on one sender: a request whose pages are not free
//! yet is parked in a bounded [`WaitQueue`] and retried as pages come
//! back (until `pd_alloc_fail_backoff_ttl`), while every other sender's
//! frames are answered at once. Senders without a handshake are refused
//! before any page is taken.

use super::super::counters::MessageKind;
use super::super::lock;
use super::super::zmq_io::{router_reply, router_try_recv, Received};
use super::Shared;
use crate::auth::{FrameKind, OpenError};
use crate::channel::{Access, GrantTag, ReadOp, TransferOp};
use crate::config::TransferMode;
use crate::memory::{ChunkMeta, MemObj, MemoryError};
use crate::protocol::admission::{BatchOf, Gate};
use crate::protocol::notice::{encode_reply, route_node};
use crate::protocol::{
    AllocRequest, AscendAllocResponse, CacheQueryResponse, CancelNotif, EagerRead, Message,
    PullReadyDoneAck, PullReadyNotif, PushNotice, Retry, SendPullDone, Verdict, WaitQueue,
    MAX_WAITING,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often parked requests look for freed pages (only while some wait).
const RETRY_TICK: Duration = Duration::from_millis(2);

/// How long the loop sleeps in `poll` when nothing waits (bounds the
/// delay of a shutdown).
const IDLE_TICK: Duration = Duration::from_millis(100);

/// Work that must follow the reply (ack always before Done / reads).
#[derive(Default)]
struct AfterReply {
    dones: Vec<SendPullDone>,
    read: Option<EagerRead>,
}

/// A request in the wait queue.
enum Parked {
    /// A frame of a route that already had a request waiting, not read
    /// yet (frames of one route are answered in order), and when it came.
    Frame(Vec<u8>, Instant),
    /// An `AllocRequest` waiting for pages (planned afresh on each retry,
    /// so whatever changed meanwhile is seen).
    Alloc(AllocRequest),
    /// A pull-eager `PullReadyNotif` waiting for pages, and when it came.
    Pull(PullReadyNotif, Instant),
}

/// What serving a request gave.
enum Served {
    /// The reply to send now, and what follows it.
    Reply(Vec<u8>, AfterReply),
    /// Its pages are not free yet; Done signals planning freed meanwhile.
    Wait(Vec<SendPullDone>),
}

pub(super) fn request_loop(s: &Arc<Shared>, sock: zmq::Socket) {
    let mut waiting: WaitQueue<Parked> = WaitQueue::new(MAX_WAITING);
    while !s.stop.load(Ordering::Acquire) {
        let now = Instant::now();
        let tick = match waiting.next_deadline() {
            None => IDLE_TICK,
            Some(d) => RETRY_TICK.min(d.saturating_duration_since(now)),
        };
        if let Err(e) = sock.poll(zmq::POLLIN, tick.as_millis() as i64) {
            log::warn!("request socket failed: {e}");
            break;
        }
        if !waiting.is_empty() {
            retry_waiting(s, &sock, &mut waiting);
        }
        loop {
            publish(s, &waiting);
            match router_try_recv(&sock) {
                Ok(Received::Request(req)) => {
                    on_frame(s, &sock, &mut waiting, req.route, req.frame)
                }
                Ok(Received::Junk) => {
                    if s.counters.bump(MessageKind::Malformed) == 0 {
                        log::warn!(
                            "a message on the request socket is not a REQ envelope; dropped (logged once)"
                        );
                    }
                }
                Ok(Received::Nothing) => break,
                Err(e) => {
                    log::warn!("request socket failed: {e}");
                    s.stop.store(true, Ordering::Release);
                    break;
                }
            }
        }
    }
    publish(s, &waiting);
    // Shutting down: whoever still waits hears that it failed now rather
    // than at its own timeout.
    for w in waiting.drain() {
        let reply = match &w.item {
            Parked::Pull(..) => failed_ack(),
            Parked::Alloc(_) => failed_reply(),
            Parked::Frame(frame, _) => failure_for(frame, "the receiver is stopping"),
        };
        reply_to(s, &sock, &w.route, reply);
    }
}

/// Sends `reply` to `route` (sealed for its sender, with a secret: when its
/// attachment is gone, nothing is sent and the requester times out).
fn reply_to(s: &Shared, sock: &zmq::Socket, route: &[u8], reply: Vec<u8>) {
    let name = String::from_utf8_lossy(route);
    let Some(reply) = s.seal_for(route_node(&name), FrameKind::Reply, reply) else {
        log::debug!("no reply to {name:?}: its sender is no longer attached");
        return;
    };
    if let Err(e) = router_reply(sock, route, &reply) {
        log::warn!("could not reply on the request socket to {name:?}: {e}");
    }
}

/// Counts and logs (at debug: a flood must not flood the log) a frame that
/// failed authentication; it is dropped unanswered and never acted on.
fn auth_dropped(s: &Shared, socket: &str, from: &str, e: OpenError) {
    s.counters.bump(MessageKind::AuthDropped);
    log::debug!("dropped a frame on the {socket} from {from:?}: {e}");
}

/// Answers upstream LMCache's `CacheQueryRequest` on `pd_peer_query_port`
/// (a REP socket) until the receiver stops. Anything else gets an empty
/// answer (a REQ peer needs one) and is counted as malformed.
pub(super) fn query_loop(s: &Shared, sock: zmq::Socket) {
    while !s.stop.load(Ordering::Acquire) {
        let frame = match sock.recv_bytes(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => continue,
            Err(e) => {
                log::warn!("query socket: {e}; it stops answering");
                return;
            }
        };
        // With a secret, only an attached sender may ask (the answer says
        // which prompts this worker holds); anyone else gets an empty frame
        // (the REP socket must answer something) and nothing is looked up.
        let frame = match s.open_request(None, frame) {
            Ok(f) => f,
            Err(e) => {
                auth_dropped(s, "query socket", "?", e);
                let _ = sock.send(Vec::new(), 0);
                continue;
            }
        };
        let answer = match Message::decode(&frame) {
            Ok(Message::CacheQueryRequest(q)) => {
                s.counters.bump(MessageKind::CacheQuery);
                lock(&s.core).query(&q.keys)
            }
            other => {
                if s.counters.bump(MessageKind::Malformed) == 0 {
                    let what = match other {
                        Ok(m) => m.message_type().to_string(),
                        Err(e) => e.to_string(),
                    };
                    log::warn!(
                        "the query port takes CacheQueryRequest only, not {what} (answered with \
                         nothing cached; logged once)"
                    );
                }
                CacheQueryResponse::default()
            }
        };
        let _ = sock.send(Message::CacheQueryResponse(answer).encode(), 0);
    }
}

/// What an `AllocRequest` says about its request, when it carries
/// upstream's async fields (a request sent in several batches).
fn batch_of(req: &AllocRequest) -> Option<BatchOf<'_>> {
    batch(&req.req_id, req.total_chunks, req.is_last_batch)
}

fn batch(req_id: &Option<String>, total: Option<u64>, last: Option<bool>) -> Option<BatchOf<'_>> {
    match (req_id, total) {
        (Some(r), Some(n)) => Some(BatchOf {
            req_id: r,
            total_chunks: usize::try_from(n).unwrap_or(usize::MAX),
            last: last.unwrap_or(false),
        }),
        _ => None,
    }
}

/// Pages for `metas` through the admission gate (see `protocol::admission`):
/// a request that announced its size (`of`) is admitted whole or refused
/// now, other batches take only pages nobody reserved. `None`: wait for
/// pages (the caller parks the request); the last try (`!may_wait`) never
/// waits and never takes reserved pages.
fn admitted_pages(
    s: &Shared,
    of: Option<BatchOf<'_>>,
    metas: &[ChunkMeta],
    may_wait: bool,
) -> Option<Result<Vec<MemObj>, MemoryError>> {
    let free = s.alloc.primary().stats().free;
    let now = Instant::now();
    let gate = lock(&s.admission).admit(now, of, metas.len(), free);
    let pages = match gate {
        Gate::Refuse(why) => {
            log::warn!("{why}");
            Err(MemoryError::NotAdmitted(why))
        }
        Gate::Wait if may_wait => return None,
        Gate::Wait => Err(MemoryError::NotAdmitted(format!(
            "{} page(s) needed, but the free pages are reserved by multi-batch requests",
            metas.len()
        ))),
        // Outside the core's lock, and never waiting here.
        Gate::Go => match s.alloc.try_allocate_batch(metas) {
            Ok(Some(p)) => Ok(p),
            Ok(None) if may_wait => return None,
            Ok(None) => s.alloc.allocate_batch(metas),
            Err(e) => Err(e),
        },
    };
    if let Ok(p) = &pages {
        lock(&s.admission).allocated(now, of, p.len());
    }
    Some(pages)
}

/// The admission of a pull-eager notification (the same gate as a push
/// batch's: see `protocol::admission`).
fn pull_batch_of(notif: &PullReadyNotif) -> Option<BatchOf<'_>> {
    batch(&notif.req_id, notif.total_chunks, notif.is_last_batch)
}

/// The failure reply of the frame's own kind: a push notice's refusal,
/// a failed ack for a pull notification, a failed allocation otherwise.
fn failure_for(frame: &[u8], why: &str) -> Vec<u8> {
    if PushNotice::decode(frame).is_some() {
        return encode_reply(&Err(why.to_string()));
    }
    match Message::decode(frame) {
        Ok(Message::PullReadyNotif(_)) => failed_ack(),
        Ok(Message::CacheQueryRequest(_)) => {
            Message::CacheQueryResponse(CacheQueryResponse::default()).encode()
        }
        // Nothing was dropped.
        Ok(Message::CancelNotif(c)) => Message::CancelNotif(CancelNotif {
            req_id: c.req_id,
            keys: Vec::new(),
        })
        .encode(),
        _ => failed_reply(),
    }
}

/// A frame just read: answered at once, or parked.
fn on_frame(
    s: &Arc<Shared>,
    sock: &zmq::Socket,
    waiting: &mut WaitQueue<Parked>,
    route: Vec<u8>,
    frame: Vec<u8>,
) {
    let deadline = Instant::now() + s.config.alloc_fail_backoff_ttl;
    let name = String::from_utf8_lossy(&route).into_owned();
    let frame = match s.open_request(Some(&name), frame) {
        Ok(f) => f,
        Err(e) => return auth_dropped(s, "request socket", &name, e),
    };
    if waiting.holds(&route) {
        if let Err(Parked::Frame(frame, _)) = waiting.park(
            route.clone(),
            Parked::Frame(frame, Instant::now()),
            deadline,
        ) {
            // The queue is full; the frame's type decides the reply's.
            let reply = failure_for(&frame, "too many requests wait for pages; try again");
            refuse_full(s, &name);
            send(s, sock, &route, reply, AfterReply::default());
        }
        return;
    }
    let parked = match read_frame(s, &name, &frame, Instant::now()) {
        Ok(p) => p,
        Err(reply) => return send(s, sock, &route, reply, AfterReply::default()),
    };
    match serve(s, &name, &parked, true) {
        Served::Reply(reply, after) => send(s, sock, &route, reply, after),
        Served::Wait(dones) => {
            send_dones(s, dones);
            if let Err(parked) = waiting.park(route.clone(), parked, deadline) {
                refuse_full(s, &name);
                let reply = match parked {
                    Parked::Pull(..) => failed_ack(),
                    _ => failed_reply(),
                };
                send(s, sock, &route, reply, AfterReply::default());
            }
        }
    }
}

/// Serves what waits, oldest first, one request per route.
fn retry_waiting(s: &Arc<Shared>, sock: &zmq::Socket, waiting: &mut WaitQueue<Parked>) {
    waiting.retry(Instant::now(), |w, last| {
        let name = String::from_utf8_lossy(&w.route).into_owned();
        if let Parked::Frame(frame, arrived) = &w.item {
            match read_frame(s, &name, frame, *arrived) {
                Ok(p) => w.item = p,
                Err(reply) => {
                    send(s, sock, &w.route, reply, AfterReply::default());
                    return Retry::Answered;
                }
            }
        }
        match serve(s, &name, &w.item, !last) {
            Served::Reply(reply, after) => {
                send(s, sock, &w.route, reply, after);
                Retry::Answered
            }
            Served::Wait(dones) => {
                send_dones(s, dones);
                Retry::StillWaiting
            }
        }
    });
}

fn publish(s: &Shared, waiting: &WaitQueue<Parked>) {
    s.waiting.store(waiting.len(), Ordering::Relaxed);
    s.refused_waiting
        .store(waiting.refused(), Ordering::Relaxed);
}

fn refuse_full(s: &Shared, route: &str) {
    if s.counters.bump(MessageKind::Rejected) == 0 {
        log::warn!(
            "{MAX_WAITING} requests already wait for pages; refused the one from {route:?} at once \
             (replied alloc_failed; logged once). Free pages sooner (smaller requests, prompt \
             loads) or give the receiver a larger pool."
        );
    }
}

fn send(s: &Shared, sock: &zmq::Socket, route: &[u8], reply: Vec<u8>, after: AfterReply) {
    reply_to(s, sock, route, reply);
    send_dones(s, after.dones);
    if let Some(read) = after.read {
        start_eager_read(s, read);
    }
}

fn send_dones(s: &Shared, dones: Vec<SendPullDone>) {
    for d in dones {
        s.send_done(d);
    }
}

/// A failed AscendAllocResponse: the reply to frames that cannot be served.
fn failed_reply() -> Vec<u8> {
    Message::AscendAllocResponse(AscendAllocResponse {
        already_sent_indexes: Vec::new(),
        remote_indexes: Vec::new(),
        remote_buffer_uuids: Vec::new(),
        alloc_failed: true,
    })
    .encode()
}

fn failed_ack() -> Vec<u8> {
    Message::PullReadyDoneAck(PullReadyDoneAck {
        already_sent_indexes: Vec::new(),
        alloc_failed: true,
    })
    .encode()
}

/// Decodes and counts a frame. Push notices and frames that cannot be
/// served are answered at once (`Err`: the reply); requests that may need
/// pages come back to be served.
fn read_frame(s: &Shared, route: &str, frame: &[u8], arrived: Instant) -> Result<Parked, Vec<u8>> {
    if let Some(notice) = PushNotice::decode(frame) {
        s.counters.bump(MessageKind::PushNotice);
        let result = notice.and_then(|n| {
            // The grant is released before any key becomes resident, so no
            // request under it can start once loads may see the pages.
            let reply =
                lock(&s.core).on_push_notice(Instant::now(), route, &n, |g| s.channel.release(g));
            s.landed.notify_all();
            reply.result
        });
        if let Err(e) = &result {
            if s.counters.bump(MessageKind::Rejected) == 0 {
                log::warn!("refused a push notice from {route:?}: {e} (logged once)");
            }
        }
        return Err(encode_reply(&result));
    }
    let msg = match Message::decode(frame) {
        Ok(m) => m,
        Err(e) => {
            if s.counters.bump(MessageKind::Malformed) == 0 {
                log::warn!(
                    "malformed frame on the request socket: {e} (replied alloc_failed; logged once)"
                );
            }
            return Err(failed_reply());
        }
    };
    match msg {
        Message::AllocRequest(req) if s.mode == TransferMode::Push => {
            s.counters.bump(MessageKind::AllocRequest);
            Ok(Parked::Alloc(req))
        }
        // With a secret the route is bound to an attachment: a notification
        // naming another sender (whose pages it would have us read) is refused.
        Message::PullReadyNotif(notif)
            if s.channel.auth().is_some() && notif.sender_id != route_node(route) =>
        {
            auth_dropped(s, "request socket", route, OpenError::UnknownAttachment);
            Err(failed_ack())
        }
        Message::PullReadyNotif(notif) if s.mode.is_pull() => {
            s.counters.bump(MessageKind::PullReadyNotif);
            Ok(Parked::Pull(notif, arrived))
        }
        Message::CacheQueryRequest(q) => {
            s.counters.bump(MessageKind::CacheQuery);
            Err(Message::CacheQueryResponse(lock(&s.core).query(&q.keys)).encode())
        }
        Message::CancelNotif(c) => {
            s.counters.bump(MessageKind::CancelNotif);
            // Only a sender with a handshake may drop keys: anyone else who
            // reaches the socket could otherwise delete other requests' KV.
            let keys = if s.attached(route_node(route)).is_some() {
                s.cancel(&c.req_id, &c.keys)
            } else {
                if s.counters.bump(MessageKind::Rejected) == 0 {
                    log::warn!(
                        "ignored a CancelNotif from route {route:?}, which has no handshake \
                         (logged once)"
                    );
                }
                Vec::new()
            };
            Err(Message::CancelNotif(CancelNotif {
                req_id: c.req_id,
                keys,
            })
            .encode())
        }
        other => {
            if s.counters.bump(MessageKind::Malformed) == 0 {
                log::warn!(
                    "{} does not belong on a {} receiver's request socket (replied alloc_failed; logged once)",
                    other.message_type(),
                    s.mode
                );
            }
            let reply = match other {
                Message::PullReadyNotif(_) => failed_ack(),
                _ => failed_reply(),
            };
            Err(reply)
        }
    }
}

/// Serves a decoded request. With `may_wait`, a request whose pages are
/// not free yet comes back as [`Served::Wait`]; without, that is its last
/// try and it fails (counted by the pool).
fn serve(s: &Shared, route: &str, p: &Parked, may_wait: bool) -> Served {
    match p {
        Parked::Alloc(req) => serve_alloc(s, route, req, may_wait),
        Parked::Pull(notif, arrived) => serve_pull(s, route, notif, *arrived, may_wait),
        Parked::Frame(..) => unreachable!("frames are read before they are served"),
    }
}

fn serve_alloc(s: &Shared, route: &str, req: &AllocRequest, may_wait: bool) -> Served {
    let planned = lock(&s.core).plan_push(Instant::now(), route, req);
    let reply = match planned {
        Err(reply) => {
            // Nothing to allocate (all present, or refused): a last batch
            // still ends its request's reservation.
            if let Some(b) = batch_of(req).filter(|b| b.last) {
                lock(&s.admission).release(b.req_id);
            }
            *reply
        }
        Ok(plan) => {
            // Only a sender with a handshake can be granted pages; nobody
            // else may hold (or wait for) any.
            let writer = match (s.attached(route_node(route)), GrantTag::of_route(route)) {
                (Some(link), Some(tag)) => Some((link.peer, tag)),
                (Some(_), None) => {
                    log::warn!(
                        "refused to grant pages to route {route:?}: it does not end in \
                         #<number> as an ascend-pd sender's does"
                    );
                    None
                }
                (None, _) => None,
            };
            match writer {
                None => lock(&s.core).refuse_push(plan),
                Some((peer, tag)) => {
                    // A multi-batch request (upstream's async fields) is
                    // admitted whole or refused now; other batches use only
                    // pages nobody reserved.
                    let Some(pages) = admitted_pages(s, batch_of(req), plan.metas(), may_wait)
                    else {
                        return Served::Wait(lock(&s.core).shelve_push(plan));
                    };
                    // The writer may touch exactly these pages, from now
                    // until its notice (or the revoke after the deadline);
                    // without a grant they are never advertised. Tagged
                    // with the route: a write the sender queued under an
                    // earlier allocation of these pages (on another route)
                    // is refused under this one.
                    let granted = plan.check_pages(pages).map(|p| {
                        let refs: Vec<_> = p.iter().map(|m| m.buffer_ref()).collect();
                        let grant = s
                            .channel
                            .grant(peer, Access::Write, tag, &refs)
                            .map_err(|e| log::warn!("granting {route:?} its pages: {e}"))
                            .ok();
                        (p, grant)
                    });
                    lock(&s.core).commit_push(Instant::now(), plan, granted)
                }
            }
        }
    };
    note_verdict(s, &reply.verdict);
    s.counters.bump(MessageKind::AllocResponse);
    let after = AfterReply {
        dones: reply.done,
        read: None,
    };
    Served::Reply(Message::AscendAllocResponse(reply.response).encode(), after)
}

fn serve_pull(
    s: &Shared,
    route: &str,
    notif: &PullReadyNotif,
    arrived: Instant,
    may_wait: bool,
) -> Served {
    let link = s.attached(&notif.sender_id);
    let lease = link.as_ref().map(|l| l.lease);
    // Asked before the core's lock is taken (the channel has locks of its own).
    let cap = match (&link, s.mode) {
        (Some(l), TransferMode::PullDelay) => s.proxy_cap(l),
        _ => Some(0),
    };
    let mut core = lock(&s.core);
    // The lease is counted from the notification's arrival, however long
    // it then waited for pages.
    let planned = core.plan_pull_since(Instant::now(), arrived, route, notif, lease);
    if s.mode == TransferMode::PullDelay {
        // Checked and stored under one lock: the cap holds however many
        // notifications of one sender arrive.
        let reply = match (planned, cap) {
            (Err(reply), _) => *reply,
            (Ok(plan), Some(cap)) => core.commit_pull_delay_capped(plan, cap),
            // The channel has not verified the sender's pages yet (hccl:
            // its setup, which the sender's side already finished, is
            // still running here): wait as for pages, never in this loop.
            (Ok(plan), None) if may_wait => return Served::Wait(core.shelve_pull(plan)),
            (Ok(plan), None) => {
                log::warn!(
                    "the transfer channel did not verify sender {}'s pages within \
                     pd_alloc_fail_backoff_ttl (its hccl setup is still running): its \
                     notification is refused, as none of its pages may hold a proxy yet; the \
                     sender may retry",
                    notif.sender_id
                );
                core.commit_pull_delay_capped(plan, 0)
            }
        };
        drop(core);
        // Proxies can be loaded at once: wake whoever waits for them
        // (`Receiver::wait_loadable`), as a landing does.
        s.landed.notify_all();
        return pull_reply(s, reply);
    }
    drop(core);
    let reply = match planned {
        Err(reply) => {
            // Nothing to allocate (all present, or refused): a last
            // notification still ends its request's reservation.
            if let Some(b) = pull_batch_of(notif).filter(|b| b.last) {
                lock(&s.admission).release(b.req_id);
            }
            *reply
        }
        Ok(plan) if s.mode == TransferMode::PullEager => {
            // A request that announced its size is admitted whole or
            // refused now; other notifications use only unreserved pages.
            let Some(pages) = admitted_pages(s, pull_batch_of(notif), plan.metas(), may_wait)
            else {
                return Served::Wait(lock(&s.core).shelve_pull(plan));
            };
            lock(&s.core).commit_pull_eager(plan, pages)
        }
        Ok(plan) => lock(&s.core).commit_pull_delay(plan),
    };
    pull_reply(s, reply)
}

fn pull_reply(s: &Shared, reply: crate::protocol::receiver::PullReply) -> Served {
    note_verdict(s, &reply.verdict);
    s.counters.bump(MessageKind::PullReadyDoneAck);
    let after = AfterReply {
        dones: reply.done,
        read: reply.read,
    };
    Served::Reply(Message::PullReadyDoneAck(reply.ack).encode(), after)
}

fn note_verdict(s: &Shared, v: &Verdict) {
    match v {
        Verdict::Accepted { .. } => {}
        Verdict::AllocFailed(e) => {
            log::warn!("allocation failed, replied alloc_failed: {e}");
        }
        Verdict::Rejected(e) => {
            if s.counters.bump(MessageKind::Rejected) == 0 {
                log::warn!("rejected a message: {e} (logged once)");
            }
        }
        Verdict::Withdrawn { req_id, keys } => {
            log::debug!(
                "request {req_id:?} was cancelled here before its {keys} key(s) came: answered \
                 them as already sent (nothing allocated or read)"
            );
        }
    }
}

/// Hands an eager pull's read to the reader (after its ack went out).
fn start_eager_read(s: &Shared, read: EagerRead) {
    let refused = match &*lock(&s.eager) {
        Some(tx) => tx.send(read).err().map(|e| e.into_inner()),
        None => Some(read),
    };
    if let Some(read) = refused {
        // Only when the receiver is stopping: the read fails, its pages
        // go back with the pull, and its Done goes out.
        log::warn!(
            "eager read of pull {} not started: the receiver is stopping",
            read.pull_id
        );
        finish_eager_read(s, &read.pull_id, None);
    }
}

/// How often the reader looks at the reads in flight.
const READ_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// One eager read in flight.
struct InFlight {
    pull_id: String,
    bytes: u64,
    deadline: Instant,
    completion: crate::channel::Completion<MemObj>,
}

/// The eager reader: one thread starts every pull-eager read as it comes
/// and watches all of them, so a sender that stalls its reads holds only
/// its own (each until its pull's deadline), never a thread or another
/// sender's read. Reads in flight are bounded by the pages they own. Ends
/// when the request loop has dropped the queue: reads still in flight are
/// then given up (their pages stay quarantined until the transfers end).
pub(super) fn eager_reader(s: &Arc<Shared>, rx: crossbeam_channel::Receiver<EagerRead>) {
    let mut flying: Vec<InFlight> = Vec::new();
    loop {
        let wait = if flying.is_empty() {
            std::time::Duration::from_millis(100)
        } else {
            READ_POLL
        };
        match rx.recv_timeout(wait) {
            Ok(read) => {
                // Start whatever else is queued too before polling.
                for read in std::iter::once(read).chain(rx.try_iter()) {
                    if s.stop.load(Ordering::Acquire) {
                        // Stopping: fail it without starting it.
                        end_read(s, &read.pull_id.clone(), 0, None);
                        continue;
                    }
                    if let Some(f) = start_read(s, read) {
                        flying.push(f);
                    }
                }
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        }
        let now = Instant::now();
        flying.retain_mut(|f| match f.completion.poll() {
            Some(done) => {
                let pages = match done.result {
                    Ok(()) if Instant::now() < f.deadline => Some(done.pages),
                    Ok(()) => {
                        log::warn!(
                            "eager read of pull {} finished only at its lease's end",
                            f.pull_id
                        );
                        None
                    }
                    Err(e) => {
                        log::warn!("eager read of pull {} failed: {e}", f.pull_id);
                        None
                    }
                };
                end_read(s, &f.pull_id, f.bytes, pages);
                false
            }
            None if now >= f.deadline => {
                log::warn!(
                    "eager read of pull {} did not finish within its lease",
                    f.pull_id
                );
                end_read(s, &f.pull_id, f.bytes, None);
                false
            }
            None => true,
        });
    }
    for f in flying {
        log::warn!(
            "eager read of pull {} given up: the receiver is stopping",
            f.pull_id
        );
        end_read(s, &f.pull_id, f.bytes, None);
    }
}

/// Starts one read; `None` when it could not start (already ended).
fn start_read(s: &Shared, read: EagerRead) -> Option<InFlight> {
    let EagerRead {
        pull_id,
        sender_id,
        read_by,
        deadline,
        items,
        pages,
    } = read;
    let bytes: u64 = items.iter().map(|i| i.bytes as u64).sum();
    let ops: Vec<ReadOp> = items
        .iter()
        .zip(pages)
        .map(|(i, page)| TransferOp {
            local: page,
            remote: i.remote,
            local_offset: 0,
            remote_offset: 0,
            len: i.bytes,
        })
        .collect();
    let fail = |why: String| {
        log::warn!("eager read of pull {pull_id}: {why}");
        end_read(s, &pull_id, bytes, None);
        None
    };
    if Instant::now() >= read_by {
        return fail("could not start before its read window closed".into());
    }
    let Some(peer) = s.attached(&sender_id).map(|l| l.peer) else {
        return fail(format!("sender {sender_id} is not attached"));
    };
    match s.channel.submit_read(peer, ops) {
        Ok(completion) => Some(InFlight {
            pull_id,
            bytes,
            deadline,
            completion,
        }),
        Err(e) => fail(format!("could not start: {e}")),
    }
}

fn end_read(s: &Shared, pull_id: &str, bytes: u64, pages: Option<Vec<MemObj>>) {
    if pages.is_some() {
        s.counters.add_bytes(bytes);
    } else {
        s.counters.bump(MessageKind::TransferError);
    }
    finish_eager_read(s, pull_id, pages);
}

fn finish_eager_read(s: &Shared, pull_id: &str, read: Option<Vec<MemObj>>) {
    let done = lock(&s.core).on_read_complete(pull_id, read);
    s.landed.notify_all();
    if let Some(d) = done {
        s.send_done(d);
    }
}
