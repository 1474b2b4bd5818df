//! The receiver's request socket: a ROUTER on `pd_peer_alloc_port` that
//! LMCache-style REQ senders talk to. The requester's identity is its
//! route, which names the writer of a push. Each frame is an
//! `AllocRequest`, a `PullReadyNotif` or one of our push notices; the core
//! decides the answer, this loop allocates pages (outside the core's lock),
//! grants them on the channel, replies, and starts pull-eager reads.

use super::super::counters::MessageKind;
use super::super::lock;
use super::super::zmq_io::{router_recv, router_reply};
use super::Shared;
use crate::channel::{Access, GrantTag, ReadOp, TransferOp};
use crate::config::TransferMode;
use crate::memory::MemObj;
use crate::protocol::notice::{encode_reply, route_node};
use crate::protocol::{
    AscendAllocResponse, EagerRead, Message, PullReadyDoneAck, PushNotice, SendPullDone, Verdict,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Work that must follow the reply (ack always before Done / reads).
#[derive(Default)]
struct AfterReply {
    dones: Vec<SendPullDone>,
    read: Option<EagerRead>,
}

pub(super) fn request_loop(s: &Arc<Shared>, sock: zmq::Socket) {
    while !s.stop.load(Ordering::Acquire) {
        let req = match router_recv(&sock) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(e) => {
                log::warn!("request socket failed: {e}");
                break;
            }
        };
        // Our senders name their sockets `<node>#<n>`; others get ZMQ's
        // binary ids, which only ever name a route here.
        let route = String::from_utf8_lossy(&req.route).into_owned();
        let (reply, after) = handle_frame(s, &route, &req.frame);
        if let Err(e) = router_reply(&sock, &req.route, &reply) {
            log::warn!("could not reply on the request socket to {route:?}: {e}");
        }
        for d in after.dones {
            s.send_done(d);
        }
        if let Some(read) = after.read {
            start_eager_read(s, read);
        }
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

fn handle_frame(s: &Shared, route: &str, frame: &[u8]) -> (Vec<u8>, AfterReply) {
    let mut after = AfterReply::default();
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
        return (encode_reply(&result), after);
    }
    let msg = match Message::decode(frame) {
        Ok(m) => m,
        Err(e) => {
            if s.counters.bump(MessageKind::Malformed) == 0 {
                log::warn!(
                    "malformed frame on the request socket: {e} (replied alloc_failed; logged once)"
                );
            }
            return (failed_reply(), after);
        }
    };
    match msg {
        Message::AllocRequest(req) if s.mode == TransferMode::Push => {
            s.counters.bump(MessageKind::AllocRequest);
            let planned = lock(&s.core).plan_push(Instant::now(), route, &req);
            let reply = match planned {
                Err(reply) => *reply,
                Ok(plan) => {
                    // Outside the core's lock: waiting for pages must not
                    // stall lookups, loads or the sweeper.
                    let pages = plan.check_pages(s.alloc.allocate_batch_until(
                        plan.metas(),
                        Instant::now() + s.config.alloc_fail_backoff_ttl,
                    ));
                    // The writer may touch exactly these pages, from now
                    // until its notice (or the revoke after the deadline);
                    // without a grant they are never advertised.
                    let granted = pages.map(|p| {
                        // Tagged with the route: a write the sender queued
                        // under an earlier allocation of these pages (on
                        // another route) is refused under this one.
                        let tag = GrantTag::of_route(route);
                        let grant = match (s.attached(route_node(route)), tag) {
                            (Some(link), Some(tag)) => {
                                let refs: Vec<_> = p.iter().map(|m| m.buffer_ref()).collect();
                                s.channel
                                    .grant(link.peer, Access::Write, tag, &refs)
                                    .map_err(|e| log::warn!("granting {route:?} its pages: {e}"))
                                    .ok()
                            }
                            (Some(_), None) => {
                                log::warn!(
                                    "refused to grant pages to route {route:?}: it does not end in \
                                     #<number> as an ascend-pd sender's does"
                                );
                                None
                            }
                            (None, _) => None,
                        };
                        (p, grant)
                    });
                    lock(&s.core).commit_push(Instant::now(), plan, granted)
                }
            };
            note_verdict(s, &reply.verdict);
            after.dones = reply.done;
            s.counters.bump(MessageKind::AllocResponse);
            (Message::AscendAllocResponse(reply.response).encode(), after)
        }
        Message::PullReadyNotif(notif) if s.mode.is_pull() => {
            s.counters.bump(MessageKind::PullReadyNotif);
            let lease = s.attached(&notif.sender_id).map(|l| l.lease);
            let planned = lock(&s.core).plan_pull(Instant::now(), route, &notif, lease);
            let reply = match planned {
                Err(reply) => *reply,
                Ok(plan) if s.mode == TransferMode::PullEager => {
                    let pages = s.alloc.allocate_batch_until(
                        plan.metas(),
                        Instant::now() + s.config.alloc_fail_backoff_ttl,
                    );
                    lock(&s.core).commit_pull_eager(plan, pages)
                }
                Ok(plan) => lock(&s.core).commit_pull_delay(plan),
            };
            note_verdict(s, &reply.verdict);
            after.dones = reply.done;
            after.read = reply.read;
            s.counters.bump(MessageKind::PullReadyDoneAck);
            (Message::PullReadyDoneAck(reply.ack).encode(), after)
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
            (reply, after)
        }
    }
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

/// Reads an eager pull's chunks on its own thread, so a slow sender never
/// holds up the request socket or other senders' reads. The read is
/// waited for no longer than the pull's deadline; past it the sender may
/// free, so an unfinished read has failed (its pages stay with the
/// transfer until it ends).
fn start_eager_read(s: &Arc<Shared>, read: EagerRead) {
    let s2 = Arc::clone(s);
    let spawned = std::thread::Builder::new()
        .name("pd-eager-read".into())
        .spawn(move || {
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
            let read = read_pages(&s2, &pull_id, &sender_id, read_by, deadline, ops);
            if read.is_some() {
                s2.counters.add_bytes(bytes);
            } else {
                s2.counters.bump(MessageKind::TransferError);
            }
            let done = lock(&s2.core).on_read_complete(&pull_id, read);
            s2.landed.notify_all();
            if let Some(d) = done {
                s2.send_done(d);
            }
        });
    if let Err(e) = spawned {
        log::warn!("cannot start an eager read thread: {e}");
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
    match c.wait_until(deadline) {
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
