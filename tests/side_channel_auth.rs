//! With a deployment secret, every side-channel frame is sealed by its
//! attachment (issue 25, item 1). An on-path observer sits between a
//! sender and a receiver, forwards every frame, learns the ids the traffic
//! shows (routes, attachment ids, keys, uuids, pull ids, the done port) and
//! forges each frame kind from them: an `aborted` push notice, a
//! `CancelNotif`, a `CacheQueryRequest`, a replayed request, a
//! `PullDoneSignal` (bare, with a made-up MAC, and a genuine frame of
//! another socket), and a clock probe answer. Every forgery is dropped and
//! counted (`auth_dropped`), the transfer in progress completes with every
//! byte verified at the far end, and every page returns to its pool.
//! Real sockets on loopback.

mod common;

use ascend_pd::auth::{envelope_header, Secret, ENVELOPE_HEADER, PROOF_LEN};
use ascend_pd::backend::{MessageKind, PutOutcome, Receiver, Sender};
use ascend_pd::channel::handshake;
use ascend_pd::config::{ChannelKind, PdConfig, PortList, TransferMode};
use ascend_pd::memory::BufferRef;
use ascend_pd::protocol::{
    CacheQueryRequest, CancelNotif, Message, PullDoneSignal, PushNotice, PushOutcome,
};
use common::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(20);

fn secret_file(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("apd-sc-auth-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("secret");
    std::fs::write(&f, "the deployment's side-channel secret\n").unwrap();
    f
}

fn with_secret(mut c: PdConfig, f: &std::path::Path) -> PdConfig {
    c.auth_secret_file = Some(f.to_path_buf());
    c
}

fn count(messages: &[(MessageKind, u64)], kind: MessageKind) -> u64 {
    messages.iter().find(|(k, _)| *k == kind).map_or(0, |m| m.1)
}

/// The message inside a sealed frame: the envelope encrypts nothing, so
/// the observer reads it.
fn inner(frame: &[u8]) -> &[u8] {
    assert!(envelope_header(frame).is_some(), "the traffic is sealed");
    &frame[ENVELOPE_HEADER..frame.len() - PROOF_LEN]
}

/// A frame that looks sealed by the attachment of `seen` (its header, a
/// counter far ahead) around `message`, with a MAC the observer made up.
fn reseal(seen: &[u8], message: &[u8]) -> Vec<u8> {
    let mut f = seen[..ENVELOPE_HEADER].to_vec();
    let at = ENVELOPE_HEADER - 8;
    let counter = u64::from_be_bytes(f[at..].try_into().unwrap()) + 100;
    f[at..].copy_from_slice(&counter.to_be_bytes());
    f.extend_from_slice(message);
    f.extend_from_slice(&[0x5a; PROOF_LEN]);
    f
}

type Forge = Box<dyn FnMut(&[u8], &[u8], &[u8]) -> Vec<Vec<u8>> + Send>;

/// An on-path observer of the request socket: a ROUTER the sender talks to
/// and, per route, a DEALER with that route's identity talking to the
/// receiver, so the receiver sees the sender's routes as if direct. Before
/// forwarding each reply, `forge(route, request, reply)` gives frames to
/// inject on the same connection, as that route.
struct Observer {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    injected: Arc<Mutex<usize>>,
}

impl Observer {
    fn start(upstream: String, mut forge: Forge) -> Observer {
        let port = free_port();
        let stop = Arc::new(AtomicBool::new(false));
        let injected = Arc::new(Mutex::new(0));
        let (stop2, injected2) = (Arc::clone(&stop), Arc::clone(&injected));
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
        let thread = std::thread::spawn(move || {
            let ctx = zmq::Context::new();
            let front = ctx.socket(zmq::ROUTER).unwrap();
            front.set_linger(0).unwrap();
            front.bind(&format!("tcp://127.0.0.1:{port}")).unwrap();
            ready_tx.send(()).unwrap();
            // (route, dealer, the last request it forwarded)
            let mut backs: Vec<(Vec<u8>, zmq::Socket, Vec<u8>)> = Vec::new();
            while !stop2.load(Ordering::Acquire) {
                let readable: Vec<bool> = {
                    let mut items: Vec<zmq::PollItem<'_>> = std::iter::once(&front)
                        .chain(backs.iter().map(|b| &b.1))
                        .map(|s| s.as_poll_item(zmq::POLLIN))
                        .collect();
                    zmq::poll(&mut items, 50).unwrap();
                    items.iter().map(|i| i.is_readable()).collect()
                };
                if readable[0] {
                    let parts = front.recv_multipart(0).unwrap();
                    let [route, _, body] = <[Vec<u8>; 3]>::try_from(parts).unwrap();
                    let i = match backs.iter().position(|b| b.0 == route) {
                        Some(i) => i,
                        None => {
                            let d = ctx.socket(zmq::DEALER).unwrap();
                            d.set_linger(0).unwrap();
                            d.set_identity(&route).unwrap();
                            d.connect(&upstream).unwrap();
                            backs.push((route.clone(), d, Vec::new()));
                            backs.len() - 1
                        }
                    };
                    backs[i].1.send_multipart([&[][..], &body], 0).unwrap();
                    backs[i].2 = body;
                }
                for (i, r) in readable[1..].iter().enumerate() {
                    if !r {
                        continue;
                    }
                    let (route, dealer, request) = &backs[i];
                    let parts = dealer.recv_multipart(0).unwrap();
                    let [_, reply] = <[Vec<u8>; 2]>::try_from(parts).unwrap();
                    for f in forge(route, request, &reply) {
                        dealer.send_multipart([&[][..], &f], 0).unwrap();
                        *injected2.lock().unwrap() += 1;
                    }
                    front
                        .send_multipart([&route[..], &[][..], &reply], 0)
                        .unwrap();
                }
            }
        });
        ready_rx.recv().unwrap();
        Observer {
            port,
            stop,
            thread: Some(thread),
            injected,
        }
    }

    fn injected(&self) -> usize {
        *self.injected.lock().unwrap()
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Push: while the receiver's allocation is on its way back, the observer
/// forges an `aborted` notice for exactly those pages (bare, as today's
/// wire would take it, and resealed with a made-up MAC), a `CancelNotif`
/// and a `CacheQueryRequest` for the request's keys, and replays the
/// sealed `AllocRequest`. The receiver drops and counts all six; the
/// genuine write lands and every byte is there.
#[test]
fn forged_notices_cancels_queries_and_replays_on_the_request_socket_are_dropped_and_counted() {
    let f = secret_file("push");
    let rc = with_secret(receiver_config(ChannelKind::Tcp, TransferMode::Push, 8), &f);
    let r = Receiver::start(&rc, 0).unwrap();
    let s = Sender::start(
        &with_secret(sender_config(ChannelKind::Tcp, TransferMode::Push, 8), &f),
        0,
        Default::default(),
    )
    .unwrap();
    let upstream = format!("tcp://127.0.0.1:{}", rc.alloc_port(0).unwrap());
    let forge: Forge = Box::new(|route, request, reply| {
        let route = String::from_utf8(route.to_vec()).unwrap();
        let (Ok(Message::AllocRequest(req)), Ok(Message::AscendAllocResponse(resp))) = (
            Message::decode(inner(request)),
            Message::decode(inner(reply)),
        ) else {
            return Vec::new();
        };
        // Everything below is learnt from the traffic.
        let refs: Vec<BufferRef> = resp
            .remote_buffer_uuids
            .iter()
            .zip(&resp.remote_indexes)
            .map(|(u, &page)| BufferRef {
                uuid: Uuid::parse_str(u).unwrap(),
                page: page as u32,
            })
            .collect();
        if refs.is_empty() {
            return Vec::new();
        }
        let aborted = PushNotice {
            route,
            outcome: PushOutcome::Aborted,
            refs,
        }
        .encode();
        let cancel = Message::CancelNotif(CancelNotif {
            req_id: req.req_id.clone().unwrap_or_default(),
            keys: req.keys.clone(),
        })
        .encode();
        let query = Message::CacheQueryRequest(CacheQueryRequest {
            keys: req.keys.clone(),
        })
        .encode();
        vec![
            aborted.clone(),
            reseal(request, &aborted),
            reseal(request, &cancel),
            query.clone(),
            reseal(request, &query),
            request.to_vec(),
        ]
    });
    let observer = Observer::start(upstream, forge);
    let mut spec = spec_for(&rc, "observed", false);
    spec.receiver_alloc_port = PortList::Single(observer.port);

    let ks = keys("observed", 3);
    let c = chunks(&s, &ks, CHUNK);
    let out = s.put(&ks, &c, &spec).unwrap();
    assert!(
        matches!(out, PutOutcome::Pushed { written: 3, .. }),
        "{out:?}"
    );
    assert_eq!(observer.injected(), 6, "every forgery went in");
    for k in &ks {
        let got = r.get_wait(k, WAIT).expect(k);
        assert!(holds(&got, k), "{k}: every byte as written");
    }
    assert!(
        eventually(WAIT, || count(
            &r.stats().messages,
            MessageKind::AuthDropped
        ) == 6),
        "{:?}",
        r.stats().messages
    );
    let m = r.stats().messages;
    assert_eq!(count(&m, MessageKind::CancelNotif), 0, "no cancel acted on");
    assert_eq!(count(&m, MessageKind::CacheQuery), 0, "no query answered");
    assert_eq!(
        count(&m, MessageKind::PushNotice),
        1,
        "only the genuine notice"
    );
    assert_eq!(count(&s.stats().messages, MessageKind::AuthDropped), 0);
    drop((observer, c));
    for k in &ks {
        assert!(r.remove(k));
    }
    assert_no_pages(r.stats().pools.cpu.unwrap(), "receiver");
    assert_no_pages(s.stats().pools.cpu.unwrap(), "sender");
}

/// Pull-delay: while the receiver's ack is on its way back, the observer
/// (which saw the pull id and the sender's done port in the notification)
/// pushes forged `PullDoneSignal`s to the sender: bare, resealed with a
/// made-up MAC, and the genuine sealed ack frame itself (a frame of
/// another socket); it also replays the sealed notification. Dropped and
/// counted on both sides; the pull stays pinned until the receiver really
/// read it, and every byte it read is right.
#[test]
fn forged_pull_done_signals_are_dropped_and_the_pull_stays_pinned_until_read() {
    let f = secret_file("pull");
    let rc = with_secret(
        receiver_config(ChannelKind::Tcp, TransferMode::PullDelay, 8),
        &f,
    );
    let r = Receiver::start(&rc, 0).unwrap();
    let s = Sender::start(
        &with_secret(
            sender_config(ChannelKind::Tcp, TransferMode::PullDelay, 8),
            &f,
        ),
        0,
        Default::default(),
    )
    .unwrap();
    let upstream = format!("tcp://127.0.0.1:{}", rc.alloc_port(0).unwrap());
    let pusher_ctx = zmq::Context::new();
    let forge: Forge = Box::new(move |_route, request, reply| {
        let Ok(Message::PullReadyNotif(n)) = Message::decode(inner(request)) else {
            return Vec::new();
        };
        let push = pusher_ctx.socket(zmq::PUSH).unwrap();
        push.set_linger(2000).unwrap();
        push.connect(&format!("tcp://{}", n.sender_done_url))
            .unwrap();
        let done = Message::PullDoneSignal(PullDoneSignal { pull_id: n.pull_id }).encode();
        push.send(done.clone(), 0).unwrap();
        push.send(reseal(request, &done), 0).unwrap();
        push.send(reply.to_vec(), 0).unwrap();
        vec![request.to_vec()]
    });
    let observer = Observer::start(upstream, forge);
    let mut spec = spec_for(&rc, "pulled", false);
    spec.receiver_alloc_port = PortList::Single(observer.port);

    let ks = keys("pulled", 3);
    let c = chunks(&s, &ks, CHUNK);
    s.put(&ks, &c, &spec).unwrap();
    drop(c);
    assert!(
        eventually(WAIT, || count(
            &s.stats().messages,
            MessageKind::AuthDropped
        ) == 3),
        "{:?}",
        s.stats().messages
    );
    assert!(
        eventually(WAIT, || count(
            &r.stats().messages,
            MessageKind::AuthDropped
        ) == 1),
        "{:?}",
        r.stats().messages
    );
    // Nothing was released: the receiver has not read yet.
    let st = s.stats();
    assert_eq!(st.pulls.pulls_pending, 1, "{:?}", st.pulls);
    assert_eq!(st.pools.cpu.unwrap().pinned, 3);
    assert_eq!(count(&st.messages, MessageKind::PullDoneSignal), 0);

    let got = r.fetch(&ks).unwrap();
    for (k, obj) in &got {
        assert!(holds(obj, k), "{k}: every byte as pinned");
    }
    drop(got);
    assert!(s.drain(WAIT), "the genuine Done released the pull");
    assert_eq!(count(&s.stats().messages, MessageKind::PullDoneSignal), 1);
    drop(observer);
    assert_no_pages(s.stats().pools.cpu.unwrap(), "sender");
    assert_no_pages(r.stats().pools.cpu.unwrap(), "receiver");
}

/// A clock probe answer the observer puts in front of the genuine one (a
/// made-up proof, and the older unproven form) is dropped and counted; the
/// probe takes the genuine answer.
#[test]
fn forged_clock_answers_are_dropped_and_the_genuine_one_is_taken() {
    let f = secret_file("clock");
    let rc = with_secret(receiver_config(ChannelKind::Tcp, TransferMode::Push, 4), &f);
    let _r = Receiver::start(&rc, 0).unwrap();
    let secret = Secret::load(&f, "test").unwrap();
    // A ROUTER/DEALER relay in front of the receiver's handshake socket.
    let ctx = zmq::Context::new();
    let port = free_port();
    let front = ctx.socket(zmq::ROUTER).unwrap();
    front.bind(&format!("tcp://127.0.0.1:{port}")).unwrap();
    let back = ctx.socket(zmq::DEALER).unwrap();
    back.connect(&format!("tcp://127.0.0.1:{}", rc.init_port(0).unwrap()))
        .unwrap();
    let relay = std::thread::spawn(move || {
        let parts = front.recv_multipart(0).unwrap();
        back.send_multipart(&parts, 0).unwrap();
        let mut answer = back.recv_multipart(0).unwrap();
        let genuine = answer.pop().unwrap();
        let mut forged_proof = answer.clone();
        // {clock_us: 1, incarnation: 7, auth_proof: "00"*32}
        let mut w = vec![0x83, 0xa8];
        w.extend_from_slice(b"clock_us");
        w.push(0x01);
        w.push(0xab);
        w.extend_from_slice(b"incarnation");
        w.push(0x07);
        w.push(0xaa);
        w.extend_from_slice(b"auth_proof");
        w.extend_from_slice(&[0xd9, 64]);
        w.extend_from_slice(&[b'0'; 64]);
        forged_proof.push(w);
        front.send_multipart(&forged_proof, 0).unwrap();
        let mut unproven = answer.clone();
        let mut w = vec![0x81, 0xa8];
        w.extend_from_slice(b"clock_us");
        w.push(0x01);
        unproven.push(w);
        front.send_multipart(&unproven, 0).unwrap();
        answer.push(genuine);
        front.send_multipart(&answer, 0).unwrap();
    });
    let mut forged = 0;
    let p = handshake::probe(
        &ctx,
        &format!("tcp://127.0.0.1:{port}"),
        WAIT,
        Some(&secret),
        &mut || forged += 1,
    )
    .unwrap();
    relay.join().unwrap();
    assert_eq!(forged, 2, "both forgeries dropped and counted");
    assert_ne!(p.clock_us, 1, "the genuine clock");
    assert_ne!(p.incarnation, Some(7), "the genuine incarnation");
    assert!(p.incarnation.is_some());
}
