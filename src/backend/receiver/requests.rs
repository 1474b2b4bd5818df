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
use crate::channel::{Access, GrantTag, ReadOp, TransferOp};
use crate::config::TransferMode;
use crate::memory::MemObj;
use crate::protocol::notice::{encode_reply, route_node};
use crate::protocol::{
    AllocRequest, AscendAllocResponse, EagerRead, Message, PullReadyDoneAck, PullReadyNotif,
    PushNotice, Retry, SendPullDone, Verdict, WaitQueue, MAX_WAITING,
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
    /// yet (frames of one route are answered in order).
    Frame(Vec<u8>),
    /// An `AllocRequest` waiting for pages (planned afresh on each retry,
    /// so whatever changed meanwhile is seen).
    Alloc(AllocRequest),
    /// A pull-eager `PullReadyNotif` waiting for pages.
    Pull(PullReadyNotif),
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
                    return;
                }
            }
        }
    }
    publish(s, &waiting);
    // Shutting down: whoever still waits hears that it failed now rather
    // than at its own timeout.
    for w in waiting.drain() {
        let reply = match w.item {
            Parked::Pull(_) => failed_ack(),
            Parked::Alloc(_) | Parked::Frame(_) => failed_reply(),
        };
        router_reply(&sock, &w.route, &reply).ok();
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
    if waiting.holds(&route) {
        if let Err(Parked::Frame(frame)) =
            waiting.park(route.clone(), Parked::Frame(frame), deadline)
        {
            // The queue is full; the frame's type decides the reply's.
            let reply = match Message::decode(&frame) {
                Ok(Message::PullReadyNotif(_)) => failed_ack(),
                _ => failed_reply(),
            };
            refuse_full(s, &name);
            send(s, sock, &route, reply, AfterReply::default());
        }
        return;
    }
    let parked = match read_frame(s, &name, &frame) {
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
                    Parked::Pull(_) => failed_ack(),
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
        if let Parked::Frame(frame) = &w.item {
            match read_frame(s, &name, frame) {
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
    if let Err(e) = router_reply(sock, route, &reply) {
        log::warn!(
            "could not reply on the request socket to {:?}: {e}",
            String::from_utf8_lossy(route)
        );
    }
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
fn read_frame(s: &Shared, route: &str, frame: &[u8]) -> Result<Parked, Vec<u8>> {
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
        Message::PullReadyNotif(notif) if s.mode.is_pull() => {
            s.counters.bump(MessageKind::PullReadyNotif);
            Ok(Parked::Pull(notif))
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
        Parked::Pull(notif) => serve_pull(s, route, notif, may_wait),
        Parked::Frame(_) => unreachable!("frames are read before they are served"),
    }
}

fn serve_alloc(s: &Shared, route: &str, req: &AllocRequest, may_wait: bool) -> Served {
    let planned = lock(&s.core).plan_push(Instant::now(), route, req);
    let reply = match planned {
        Err(reply) => *reply,
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
                    // Outside the core's lock, and never waiting here.
                    let pages = match s.alloc.try_allocate_batch(plan.metas()) {
                        Ok(Some(p)) => Ok(p),
                        Ok(None) if may_wait => return Served::Wait(plan.into_done()),
                        Ok(None) => s.alloc.allocate_batch(plan.metas()),
                        Err(e) => Err(e),
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

fn serve_pull(s: &Shared, route: &str, notif: &PullReadyNotif, may_wait: bool) -> Served {
    let link = s.attached(&notif.sender_id);
    let lease = link.map(|l| l.lease);
    let mut core = lock(&s.core);
    let planned = core.plan_pull(Instant::now(), route, notif, lease);
    if s.mode == TransferMode::PullDelay {
        // Checked and stored under one lock: the cap holds however many
        // notifications of one sender arrive.
        let reply = match (planned, link) {
            (Err(reply), _) => *reply,
            (Ok(plan), Some(link)) => core.commit_pull_delay_capped(plan, link.pages),
            (Ok(plan), None) => core.commit_pull_delay_capped(plan, 0),
        };
        drop(core);
        return pull_reply(s, reply);
    }
    drop(core);
    let reply = match planned {
        Err(reply) => *reply,
        Ok(plan) if s.mode == TransferMode::PullEager => {
            let pages = match s.alloc.try_allocate_batch(plan.metas()) {
                Ok(Some(p)) => Ok(p),
                Ok(None) if may_wait => return Served::Wait(plan.into_done()),
                Ok(None) => s.alloc.allocate_batch(plan.metas()),
                Err(e) => Err(e),
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
    }
}

/// Hands an eager pull's read to the reader pool (after its ack went out).
fn start_eager_read(s: &Shared, read: EagerRead) {
    if let Err(e) = s.eager.send(read) {
        // Only when the receiver is stopping: the read fails, its pages
        // go back with the pull.
        let read = e.into_inner();
        log::warn!(
            "eager read of pull {} not started: the receiver is stopping",
            read.pull_id
        );
        finish_eager_read(s, &read.pull_id, None);
    }
}

/// How many eager reads run at once (threads of the reader pool). A read
/// waits no longer than its pull's deadline, so a slow sender holds one
/// reader at most that long; a read whose window closed while it queued
/// fails at once.
pub(super) const EAGER_READERS: usize = 8;

/// One reader of the pool: reads pulls until the receiver stops, then
/// fails whatever is still queued.
pub(super) fn eager_reader(s: &Arc<Shared>, rx: crossbeam_channel::Receiver<EagerRead>) {
    while !s.stop.load(Ordering::Acquire) {
        match rx.recv_timeout(std::time::Duration::from_millis(100)) {
            Ok(read) => eager_read(s, read),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
        }
    }
    for read in rx.try_iter() {
        finish_eager_read(s, &read.pull_id, None);
    }
}

fn eager_read(s: &Shared, read: EagerRead) {
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
            len: i.bytes,
        })
        .collect();
    let read = read_pages(s, &pull_id, &sender_id, read_by, deadline, ops);
    if read.is_some() {
        s.counters.add_bytes(bytes);
    } else {
        s.counters.bump(MessageKind::TransferError);
    }
    finish_eager_read(s, &pull_id, read);
}

fn finish_eager_read(s: &Shared, pull_id: &str, read: Option<Vec<MemObj>>) {
    let done = lock(&s.core).on_read_complete(pull_id, read);
    s.landed.notify_all();
    if let Some(d) = done {
        s.send_done(d);
    }
}

/// The pages of a successful read, in op order; `None` when it failed.
fn read_pages(
    s: &Shared,
    pull_id: &str,
    sender_id: &str,
    read_by: Instant,
    deadline: Instant,
    ops: Vec<ReadOp>,
) -> Option<Vec<MemObj>> {
    if Instant::now() >= read_by {
        log::warn!("eager read of pull {pull_id} could not start before its read window closed");
        return None;
    }
    let Some(peer) = s.attached(sender_id).map(|l| l.peer) else {
        log::warn!("eager read of pull {pull_id}: sender {sender_id} is not attached");
        return None;
    };
    let mut c = match s.channel.submit_read(peer, ops) {
        Ok(c) => c,
        Err(e) => {
            log::warn!("eager read of pull {pull_id} could not start: {e}");
            return None;
        }
    };
    // Waited in steps, so a stopping receiver does not wait out a lease
    // (a read given up keeps its pages quarantined until it ends).
    let finished = loop {
        let step = Instant::now() + std::time::Duration::from_millis(100);
        if step >= deadline {
            break c.wait_until(deadline);
        }
        if let Some(done) = c.wait_timeout(step.saturating_duration_since(Instant::now())) {
            break Some(done);
        }
        if s.stop.load(Ordering::Acquire) {
            log::warn!("eager read of pull {pull_id} given up: the receiver is stopping");
            return None;
        }
    };
    match finished {
        Some(done) => match done.result {
            Ok(()) => Some(done.pages),
            Err(e) => {
                log::warn!("eager read of pull {pull_id} failed: {e}");
                None
            }
        },
        None => {
            log::warn!("eager read of pull {pull_id} did not finish within its lease");
            None
        }
    }
}
