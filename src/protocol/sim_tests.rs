//! A sender core and a receiver core wired through a simulated network, a
//! simulated channel and two skewed clocks (in the manner of quinn-proto's
//! test `Pair` and raft-rs's harness): messages are delayed, dropped and
//! reordered by a seeded generator, REQ timeouts fire, transfers take
//! time. The shell's job is done here exactly as the backend does it, so
//! what is checked is the protocol itself:
//!
//! * the lease invariant — no read of a pull's pages starts or completes
//!   (with its bytes used) at or after the moment the sender released them;
//! * every key that becomes resident holds exactly the bytes sent for it;
//! * when everything has settled, every page of both pools is back: none
//!   allocated, pinned or quarantined.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::channel::{GrantId, PeerId, WriteOp};
use crate::config::TransferMode;
use crate::layout::{ChunkLayout, Dtype, MemFormat};
use crate::memory::{pattern, BufferRef, ChunkMeta, MemObj, PagePool, RegisteredBuffer};

const US: u64 = 1;
const MS: u64 = 1000 * US;
const SEC: u64 = 1000 * MS;

fn layout() -> ChunkLayout {
    ChunkLayout {
        fmt: MemFormat::Kv2Ltd,
        layers: 1,
        tokens: 4,
        hidden: 8,
        dtype: Dtype::UInt8,
    }
}

fn pool(pages: usize) -> Arc<PagePool> {
    let page = layout().page_bytes();
    PagePool::new(RegisteredBuffer::host(pages * page, page, false).unwrap())
}

fn seed_of(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// xorshift64*: reproducible faults.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

/// How hostile the simulated world is.
#[derive(Clone, Copy, Debug)]
struct Faults {
    /// Longest one-way message delay.
    max_delay: u64,
    /// Percent of messages lost.
    drop_pct: u64,
    /// Longest transfer (read or write) time.
    max_transfer: u64,
    /// Percent of writes that take longer than the landing timeout.
    slow_write_pct: u64,
    /// The agreed pull lease (the sender's TTL; the receiver's is 360 s).
    lease: u64,
    /// The sender's REQ timeout.
    req_timeout: u64,
}

/// Real time is `t` (µs since the start); the sender reads `base + t`, the
/// receiver `base + t + skew` (the skew may be negative).
struct Clocks {
    base: Instant,
    skew_us: i64,
}

impl Clocks {
    fn sender(&self, t: u64) -> Instant {
        self.base + Duration::from_micros(t)
    }
    fn receiver(&self, t: u64) -> Instant {
        let us = t as i64 + self.skew_us;
        assert!(us >= -100_000_000, "skew beyond the simulated base");
        if us >= 0 {
            self.base + Duration::from_micros(us as u64)
        } else {
            self.base - Duration::from_micros((-us) as u64)
        }
    }
    /// The real time at which the receiver's clock reads `r`.
    fn real_of_receiver(&self, r: Instant) -> i128 {
        let since_base = if r >= self.base {
            r.duration_since(self.base).as_micros() as i128
        } else {
            -(self.base.duration_since(r).as_micros() as i128)
        };
        since_base - i128::from(self.skew_us)
    }
}

enum Ev {
    /// A frame reaches the receiver's request socket from `route`.
    ToReceiver {
        from: usize,
        route: String,
        frame: Vec<u8>,
        req: u64,
    },
    /// The reply to request `req` reaches sender `to`.
    Reply { to: usize, req: u64, frame: Vec<u8> },
    /// Sender `of`'s REQ timeout for request `req`.
    ReqTimeout { of: usize, req: u64 },
    /// A PullDoneSignal reaches sender `to`.
    Done { to: usize, pull_id: String },
    /// The handshake answer reaches sender `of` (the receiver read its clock at `answer`).
    Connected { of: usize, sent: u64, answer: u64 },
    /// Sender `of`'s backpressure wait ends.
    RetryPins(usize),
    /// Sender `of`'s push write ends.
    WriteEnds {
        of: usize,
        ops: Vec<WriteOp>,
        grant: GrantId,
    },
    /// A pull-eager read ends.
    EagerReadEnds { read: EagerRead },
    /// A pull-delay load of one key starts.
    LoadKey(String),
    /// A proxy read ends.
    ProxyReadEnds { proxy: ProxyEntry, started: u64 },
    /// Every sweep.
    Sweep,
    /// Sender `of`'s next put.
    NextPut(usize),
}

/// One simulated prefill worker.
struct SimSender {
    core: SenderCore,
    pool: Arc<PagePool>,
    put: Option<Put>,
    puts_left: usize,
    outstanding_req: Option<u64>,
    pending_pull_grant: Option<GrantId>,
}

struct Sim {
    rng: Rng,
    faults: Faults,
    clocks: Clocks,
    t: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: HashMap<u64, Ev>,
    next_id: u64,
    senders: Vec<SimSender>,
    receiver: ReceiverCore,
    recv_pool: Arc<PagePool>,
    mode: TransferMode,
    lease: Duration,
    req_timeout: u64,
    next_req: u64,
    // Grants: which pull each read grant is for, and when it was released.
    grant_pull: HashMap<GrantId, String>,
    next_grant: u64,
    released_at: HashMap<String, u64>,
    // Push: writes still running per receiver grant.
    writes_running: HashMap<GrantId, usize>,
    // Checks.
    keys_put: std::collections::BTreeSet<String>,
    reads_used: usize,
    reads_refused: usize,
    outcomes: Vec<String>,
}

impl Sim {
    fn new(seed: u64, mode: TransferMode, faults: Faults, senders: usize, puts: usize) -> Sim {
        let mut rng = Rng(seed | 1);
        let skew_us = rng.below(100 * SEC) as i64 - 50 * SEC as i64;
        let recv_pool = pool(12);
        let senders = (0..senders)
            .map(|i| {
                let pool = pool(16);
                let core = SenderCore::new(SenderConfig {
                    node: format!("sim-sender-{i}"),
                    done_url: format!("sender{i}:7600"),
                    mode,
                    layout: layout(),
                    pools: [pool.uuid()].into_iter().collect(),
                    pull_pending_ttl: Duration::from_micros(faults.lease),
                    alloc_fail_backoff_ttl: Duration::from_millis(300),
                    backpressure: Backpressure::new(16, 0.0),
                    reserve_pct: 0.0,
                });
                SimSender {
                    core,
                    pool,
                    put: None,
                    puts_left: puts,
                    outstanding_req: None,
                    pending_pull_grant: None,
                }
            })
            .collect();
        let receiver = ReceiverCore::new(ReceiverConfig {
            layout: layout(),
            push_landing_timeout: Duration::from_secs(5),
            read_margin_pct: 10.0,
            resident_ttl: None,
        });
        let mut sim = Sim {
            rng,
            faults,
            clocks: Clocks {
                base: Instant::now() + Duration::from_secs(100),
                skew_us,
            },
            t: 0,
            queue: BinaryHeap::new(),
            events: HashMap::new(),
            next_id: 0,
            senders,
            receiver,
            recv_pool,
            mode,
            // The sender's TTL against a receiver's 360 s: the agreed lease.
            lease: Duration::from_micros(faults.lease),
            req_timeout: faults.req_timeout,
            next_req: 0,
            grant_pull: HashMap::new(),
            next_grant: 1,
            released_at: HashMap::new(),
            writes_running: HashMap::new(),
            keys_put: Default::default(),
            reads_used: 0,
            reads_refused: 0,
            outcomes: Vec::new(),
        };
        for i in 0..sim.senders.len() {
            sim.at(0, Ev::NextPut(i));
        }
        sim.at(200 * MS, Ev::Sweep);
        sim
    }

    fn at(&mut self, t: u64, ev: Ev) {
        let id = self.next_id;
        self.next_id += 1;
        self.queue.push(Reverse((t, id)));
        self.events.insert(id, ev);
    }

    fn delay(&mut self) -> u64 {
        self.rng.below(self.faults.max_delay)
    }

    /// Sends a message unless the network loses it.
    fn send(&mut self, ev: Ev) {
        if self.rng.chance(self.faults.drop_pct) {
            return;
        }
        let d = self.delay();
        self.at(self.t + d, ev);
    }

    /// Every sender's clock reads the same: they share a host in the simulation.
    fn s_now(&self) -> Instant {
        self.clocks.sender(self.t)
    }

    fn r_now(&self) -> Instant {
        self.clocks.receiver(self.t)
    }

    /// Runs until nothing is left to do (then a long quiet stretch for TTLs).
    fn run(&mut self) {
        while let Some(Reverse((t, id))) = self.queue.pop() {
            assert!(t >= self.t, "time runs forward");
            self.t = t;
            let ev = self.events.remove(&id).expect("scheduled");
            self.handle(ev);
            self.note_grants();
            if self.t > 3600 * SEC {
                panic!("the simulation did not settle");
            }
        }
    }

    /// Records when each sender released (or revoked) each pull's grant.
    fn note_grants(&mut self) {
        for i in 0..self.senders.len() {
            let core = &mut self.senders[i].core;
            let gone: Vec<GrantId> = core
                .take_grant_releases()
                .into_iter()
                .chain(core.take_grant_revokes())
                .collect();
            // The simulated channel: a revoked read grant is quiescent at once.
            for g in core.awaiting_quiescence() {
                core.on_quiescent(g);
            }
            for g in gone {
                if let Some(pull) = self.grant_pull.get(&g) {
                    self.released_at.entry(pull.clone()).or_insert(self.t);
                }
            }
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::NextPut(i) => self.next_put(i),
            Ev::Connected { of, sent, answer } => {
                let clock = ClockMap::measure(
                    self.clocks.sender(sent),
                    self.s_now(),
                    crate::wire::micros(self.clocks.receiver(answer)),
                );
                let attached = Attached {
                    peer: PeerId(1),
                    lease: self.lease,
                    clock,
                    incarnation: 1,
                };
                let now = self.s_now();
                let sd = &mut self.senders[of];
                let mut put = sd.put.take().expect("a put connects");
                let next = sd.core.on_connected(&mut put, now, Some(attached));
                self.drive(of, put, next);
            }
            Ev::RetryPins(of) => {
                let now = self.s_now();
                let sd = &mut self.senders[of];
                let mut put = sd.put.take().expect("a put waits");
                let next = sd.core.on_pins_released(&mut put, now);
                self.drive(of, put, next);
            }
            Ev::ToReceiver {
                from,
                route,
                frame,
                req,
            } => self.receive(from, route, frame, req),
            Ev::Reply { to, req, frame } => {
                let now = self.s_now();
                let sd = &mut self.senders[to];
                if sd.outstanding_req == Some(req) {
                    sd.outstanding_req = None;
                    let mut put = sd.put.take().expect("a put waits for its reply");
                    let next = sd.core.on_reply(&mut put, now, Ok(frame));
                    self.drive(to, put, next);
                }
                // A reply after the timeout finds the socket replaced: lost.
            }
            Ev::ReqTimeout { of, req } => {
                let now = self.s_now();
                let sd = &mut self.senders[of];
                if sd.outstanding_req == Some(req) {
                    sd.outstanding_req = None;
                    let mut put = sd.put.take().expect("a put waits for its reply");
                    let next = sd.core.on_reply(&mut put, now, Err(Delivery::Unknown));
                    self.drive(of, put, next);
                }
            }
            Ev::Done { to, pull_id } => {
                let now = self.s_now();
                self.senders[to].core.on_done_signal(now, &pull_id);
            }
            Ev::WriteEnds { of, ops, grant } => {
                // The one-sided write lands now, wherever the pages are:
                // the receiver cannot stop it (shm / hccl semantics).
                for op in &ops {
                    let buf = self.recv_pool.buffer();
                    let at = op.remote.page as usize * buf.page_size();
                    // SAFETY: the simulated DMA writes `len` bytes inside page
                    // `remote.page` of the receiver's pool (the core lent it,
                    // so no local handle reads it); the source is a sealed page.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            op.local.host_bytes().unwrap().as_ptr(),
                            buf.host_ptr().unwrap().add(at),
                            op.len,
                        );
                    }
                }
                *self.writes_running.get_mut(&grant).unwrap() -= 1;
                let now = self.s_now();
                let sd = &mut self.senders[of];
                let mut put = sd.put.take().expect("a put writes");
                let next = sd.core.on_written(&mut put, now, WriteEnd::Written);
                self.drive(of, put, next);
            }
            Ev::EagerReadEnds { read } => {
                let started = self.t - 1; // recorded loosely: the check is on completion
                let _ = started;
                let pages = if self.r_now() >= read.deadline {
                    self.reads_refused += 1;
                    None
                } else {
                    let mut pages = read.pages;
                    for (page, item) in pages.iter_mut().zip(&read.items) {
                        self.copy_from_sender(&read.pull_id, &read.sender_id, item.remote, page);
                    }
                    Some(pages)
                };
                if let Some(d) = self.receiver.on_read_complete(&read.pull_id, pages) {
                    self.send_done(d);
                }
            }
            Ev::LoadKey(key) => {
                if let Ok(proxy) = self.receiver.begin_proxy_read(&key, self.r_now()) {
                    self.check_not_released(&proxy.handle.pull_id, "a read started");
                    let d = self.rng.below(self.faults.max_transfer);
                    self.at(
                        self.t + d,
                        Ev::ProxyReadEnds {
                            proxy,
                            started: self.t,
                        },
                    );
                }
            }
            Ev::ProxyReadEnds { proxy, started } => {
                let _ = started;
                let outcome = if self.r_now() >= proxy.lease_deadline {
                    self.reads_refused += 1;
                    ReadOutcome::Failed
                } else {
                    let mut page = self
                        .recv_pool
                        .allocate(proxy.meta)
                        .expect("a scratch page for the read");
                    self.copy_from_sender(
                        &proxy.handle.pull_id,
                        &proxy.sender_id,
                        proxy.remote,
                        &mut page,
                    );
                    assert!(
                        pattern::first_mismatch(page.host_bytes().unwrap(), seed_of(&proxy.key))
                            .is_none(),
                        "{}: read bytes that are not the sender's",
                        proxy.key
                    );
                    ReadOutcome::Consumed
                };
                if let Some(d) = self.receiver.end_proxy_read(&proxy.handle, outcome) {
                    self.send_done(d);
                }
            }
            Ev::Sweep => {
                let now = self.s_now();
                for sd in &mut self.senders {
                    sd.core.sweep(now);
                }
                let report = self.receiver.sweep(self.r_now());
                for d in report.done {
                    self.send_done(d);
                }
                // The simulated channel: a revoked write grant is quiescent
                // once its write is no longer running.
                for g in self.receiver.awaiting_quiescence() {
                    if self.writes_running.get(&g).copied().unwrap_or(0) == 0 {
                        self.receiver.on_quiescent(g);
                    }
                }
                let busy =
                    self.senders.iter().any(|sd| {
                        sd.put.is_some() || sd.puts_left > 0 || sd.core.pulls_pending() > 0
                    }) || self.receiver.counters().allocations_pending
                        + self.receiver.counters().allocations_quarantined
                        > 0
                        || !self.queue.is_empty();
                if busy {
                    self.at(self.t + 200 * MS, Ev::Sweep);
                }
            }
        }
    }

    /// Sends a PullDoneSignal to the sender its URL names.
    fn send_done(&mut self, d: SendPullDone) {
        let to = self.sender_of(&d.sender_id);
        self.send(Ev::Done {
            to,
            pull_id: d.signal.pull_id,
        });
    }

    fn sender_of(&self, node: &str) -> usize {
        node.strip_prefix("sim-sender-")
            .and_then(|n| n.parse().ok())
            .expect("a simulated sender's node")
    }

    /// A pull's read copies the sender's page now: it must not have been
    /// released, or the bytes may be someone else's.
    fn copy_from_sender(
        &mut self,
        pull_id: &str,
        sender: &str,
        remote: BufferRef,
        page: &mut MemObj,
    ) {
        self.check_not_released(pull_id, "a read completed");
        let pool = Arc::clone(&self.senders[self.sender_of(sender)].pool);
        let buf = pool.buffer();
        let at = remote.page as usize * buf.page_size();
        let len = page.byte_len();
        // SAFETY: the simulated DMA reads `len` bytes inside a page of the
        // sender's pool (checked by the receiver against the page size).
        let src = unsafe { std::slice::from_raw_parts(buf.host_ptr().unwrap().add(at), len) };
        page.host_bytes_mut().unwrap().copy_from_slice(src);
        self.reads_used += 1;
    }

    fn check_not_released(&self, pull_id: &str, what: &str) {
        if let Some(&at) = self.released_at.get(pull_id) {
            panic!(
                "{what} at t={} µs, after the sender released pull {pull_id} at t={at} µs",
                self.t
            );
        }
    }

    fn next_put(&mut self, i: usize) {
        if self.senders[i].puts_left == 0 {
            return;
        }
        self.senders[i].puts_left -= 1;
        let n = 1 + self.rng.below(4) as usize;
        let id = self.senders[i].puts_left;
        // Sometimes a key of an earlier put comes again (dedup), and keys
        // are shared by the senders (same prefix cached twice).
        let keys: Vec<String> = (0..n)
            .map(|k| match (k, id % 4) {
                (0, 0) if id > 0 => format!("s{i}k{}-0", id + 1),
                (0, 1) => format!("shared{id}"),
                _ => format!("s{i}k{id}-{k}"),
            })
            .collect();
        self.keys_put.extend(keys.iter().cloned());
        let pages = self.senders[i]
            .pool
            .allocate_batch(&vec![ChunkMeta::full(layout()); n]);
        let Ok(mut pages) = pages else {
            // Every page pinned: try later.
            self.senders[i].puts_left += 1;
            self.at(self.t + 100 * MS, Ev::NextPut(i));
            return;
        };
        for (p, k) in pages.iter_mut().zip(&keys) {
            pattern::fill(p.host_bytes_mut().unwrap(), seed_of(k));
        }
        let chunks = pages.into_iter().map(MemObj::seal).collect();
        let spec = PutSpec {
            peer_key: "receiver:7400".into(),
            req_id: format!("req{i}-{id}"),
            is_last_prefill: true,
        };
        let now = self.s_now();
        let (put, action) = self.senders[i].core.begin_put(now, spec, keys, chunks);
        self.drive(i, put, action);
    }

    /// Performs sender `i`'s put action as the backend shell would.
    fn drive(&mut self, i: usize, mut put: Put, action: PutAction) {
        match action {
            PutAction::Finish(end) => {
                self.outcomes.push(format!("{:?}", end.result));
                drop(put);
                let gap = self.rng.below(300 * MS);
                self.at(self.t + gap, Ev::NextPut(i));
            }
            PutAction::Connect => {
                let (d1, d2) = (self.delay(), self.delay());
                let sent = self.t;
                self.senders[i].put = Some(put);
                self.at(
                    self.t + d1 + d2,
                    Ev::Connected {
                        of: i,
                        sent,
                        answer: sent + d1,
                    },
                );
            }
            PutAction::SyncClock => {
                let (d1, d2) = (self.delay(), self.delay());
                let clock = ClockMap::measure(
                    self.s_now(),
                    self.clocks.sender(self.t + d1 + d2),
                    crate::wire::micros(self.clocks.receiver(self.t + d1)),
                );
                let now = self.s_now();
                let next = self.senders[i].core.on_clock(&mut put, now, Some(clock));
                self.drive(i, put, next);
            }
            PutAction::ProbeIncarnation => {
                // The simulated receiver never restarts: the same incarnation.
                let now = self.s_now();
                let next = self.senders[i].core.on_probed(&mut put, now, Some(1));
                self.drive(i, put, next);
            }
            PutAction::WaitForPins { until } => {
                let left = until.saturating_duration_since(self.s_now()).as_micros() as u64;
                self.senders[i].put = Some(put);
                self.at(self.t + (100 * MS).min(left + 1), Ev::RetryPins(i));
            }
            PutAction::Grant { .. } => {
                let g = GrantId(self.next_grant);
                self.next_grant += 1;
                self.senders[i].pending_pull_grant = Some(g);
                let now = self.s_now();
                let next = self.senders[i].core.on_granted(&mut put, now, Some(g));
                self.drive(i, put, next);
            }
            PutAction::Request { route, frame, kind } => {
                if kind == RequestKind::PullReadyNotif {
                    let n = PullReadyNotif::decode(&frame).unwrap();
                    let g = self.senders[i]
                        .pending_pull_grant
                        .take()
                        .expect("granted before announced");
                    self.grant_pull.insert(g, n.pull_id);
                }
                let req = self.next_req;
                self.next_req += 1;
                self.senders[i].outstanding_req = Some(req);
                self.senders[i].put = Some(put);
                self.send(Ev::ToReceiver {
                    from: i,
                    route,
                    frame,
                    req,
                });
                self.at(self.t + self.req_timeout, Ev::ReqTimeout { of: i, req });
            }
            PutAction::WriteLayer { .. } => {
                unreachable!("the simulation starts no layer-wise puts")
            }
            PutAction::Write { ops, .. } => {
                let g = self.grant_of_write(&ops);
                *self.writes_running.entry(g).or_default() += 1;
                let d = if self.rng.chance(self.faults.slow_write_pct) {
                    6 * SEC + self.rng.below(2 * SEC)
                } else {
                    self.rng.below(self.faults.max_transfer)
                };
                self.senders[i].put = Some(put);
                self.at(
                    self.t + d,
                    Ev::WriteEnds {
                        of: i,
                        ops,
                        grant: g,
                    },
                );
            }
        }
    }

    /// The grant the receiver made for the pages a write goes to.
    fn grant_of_write(&self, ops: &[WriteOp]) -> GrantId {
        // The receiver's grants are numbered by page: see `receive`.
        GrantId(1_000_000 + u64::from(ops[0].remote.page))
    }

    /// The receiver's request socket.
    fn receive(&mut self, from: usize, route: String, frame: Vec<u8>, req: u64) {
        let now = self.r_now();
        let reply = if let Some(n) = PushNotice::decode(&frame) {
            let n = n.unwrap();
            // The simulated channel: nothing is served under the grant
            // once its writes stopped running.
            let running = &self.writes_running;
            let r = self.receiver.on_push_notice(now, &route, &n, |g| {
                running.get(&g).copied().unwrap_or(0) == 0
            });
            notice::encode_reply(&r.result)
        } else {
            match Message::decode(&frame).unwrap() {
                Message::AllocRequest(a) => {
                    let reply = match self.receiver.plan_push(now, &route, &a) {
                        Err(r) => *r,
                        Ok(plan) => {
                            let pages =
                                plan.check_pages(self.recv_pool.allocate_batch(plan.metas()));
                            let granted = pages.map(|p| {
                                let g = GrantId(1_000_000 + u64::from(p[0].page()));
                                (p, Some(g))
                            });
                            self.receiver.commit_push(now, plan, granted)
                        }
                    };
                    for d in reply.done {
                        self.send_done(d);
                    }
                    Message::AscendAllocResponse(reply.response).encode()
                }
                Message::PullReadyNotif(n) => {
                    let reply = match self.receiver.plan_pull(now, &route, &n, Some(self.lease)) {
                        Err(r) => *r,
                        Ok(plan) if self.mode == TransferMode::PullEager => {
                            let pages = self.recv_pool.allocate_batch(plan.metas());
                            self.receiver.commit_pull_eager(plan, pages)
                        }
                        Ok(plan) => self.receiver.commit_pull_delay(plan),
                    };
                    let ack = Message::PullReadyDoneAck(reply.ack).encode();
                    // Ack first, then Done and the read.
                    let d = self.delay();
                    self.at(
                        self.t + d,
                        Ev::Reply {
                            to: from,
                            req,
                            frame: ack,
                        },
                    );
                    for done in reply.done {
                        self.send_done(done);
                    }
                    if let Some(read) = reply.read {
                        let d = self.rng.below(self.faults.max_transfer);
                        self.at(self.t + d, Ev::EagerReadEnds { read });
                    }
                    if self.mode == TransferMode::PullDelay {
                        // The decode worker loads the keys at random later times.
                        for k in &n.keys {
                            let d = self.rng.below(3 * SEC);
                            self.at(self.t + d, Ev::LoadKey(k.clone()));
                        }
                    }
                    return;
                }
                other => panic!("unexpected {other:?}"),
            }
        };
        self.send(Ev::Reply {
            to: from,
            req,
            frame: reply,
        });
    }

    /// After the run: resident keys hold their bytes; removing them (and
    /// everything settled) leaves both pools empty.
    fn finish(mut self) -> (usize, usize) {
        let keys = std::mem::take(&mut self.keys_put);
        let now = self.r_now();
        for k in &keys {
            if let Lookup::Resident(page) = self.receiver.get(k, now) {
                assert!(
                    pattern::first_mismatch(page.host_bytes().unwrap(), seed_of(k)).is_none(),
                    "{k}: resident with bytes that are not the sender's"
                );
            }
            self.receiver.remove(k);
        }
        for sd in &self.senders {
            let s = sd.pool.stats();
            assert_eq!(
                (s.allocated, s.pinned, s.quarantined),
                (0, 0, 0),
                "sender pool: {s:?}"
            );
        }
        let r = self.recv_pool.stats();
        assert_eq!((r.allocated, r.quarantined), (0, 0), "receiver pool: {r:?}");
        let _ = self.clocks.real_of_receiver(now);
        (self.reads_used, self.reads_refused)
    }
}

const CALM: Faults = Faults {
    max_delay: 5 * MS,
    drop_pct: 0,
    max_transfer: 20 * MS,
    slow_write_pct: 0,
    lease: 2 * SEC,
    req_timeout: 10 * SEC,
};

/// A 2 s lease (a sender TTL of 2 s against the receiver's 360 s) with
/// delays close to it.
const HOSTILE: Faults = Faults {
    max_delay: 1500 * MS,
    drop_pct: 8,
    max_transfer: 900 * MS,
    slow_write_pct: 15,
    lease: 2 * SEC,
    req_timeout: 10 * SEC,
};

/// A long lease and a short REQ timeout: replies are often lost while the
/// receiver may still read for a long time.
const LOSSY: Faults = Faults {
    max_delay: 1500 * MS,
    drop_pct: 8,
    max_transfer: 900 * MS,
    slow_write_pct: 15,
    lease: 20 * SEC,
    req_timeout: 1500 * MS,
};

#[test]
fn calm_pulls_read_everything_within_the_lease() {
    for mode in [TransferMode::PullEager, TransferMode::PullDelay] {
        for seed in 1..=10u64 {
            let mut sim = Sim::new(seed, mode, CALM, 2, 12);
            sim.run();
            let (used, refused) = sim.finish();
            assert!(used > 0, "{mode:?} seed {seed}: nothing was read");
            assert_eq!(refused, 0, "{mode:?} seed {seed}: a calm read was refused");
        }
    }
}

/// Delays up to 1.5 s, lost messages, REQ timeouts, slow transfers and
/// clocks up to 50 s apart, against a 2 s lease and against a 20 s lease
/// with a 1.5 s REQ timeout: reads that would outlive the sender's pins are
/// refused, never used, and a notification whose reply was lost keeps its
/// pins for as long as the receiver may read; no page leaks.
#[test]
fn hostile_pulls_never_read_after_the_sender_released() {
    for faults in [HOSTILE, LOSSY] {
        let mut totals = (0, 0);
        for mode in [TransferMode::PullEager, TransferMode::PullDelay] {
            for seed in 1..=60u64 {
                let mut sim = Sim::new(seed * 7919, mode, faults, 3, 10);
                sim.run();
                let (used, refused) = sim.finish();
                totals.0 += used;
                totals.1 += refused;
            }
        }
        // The faults really bit, and the protocol still got data through.
        assert!(totals.0 > 100, "{faults:?}: {totals:?}");
        if faults.lease == HOSTILE.lease {
            assert!(totals.1 > 10, "{faults:?}: {totals:?}");
        }
    }
}

/// Pushes through the same hostile world, with writes that sometimes take
/// longer than the landing timeout: no resident key holds another's bytes,
/// and every lent or quarantined page comes back.
#[test]
fn hostile_pushes_never_land_bytes_in_pages_someone_else_owns() {
    let mut refused = 0;
    for faults in [HOSTILE, LOSSY] {
        for seed in 1..=60u64 {
            let mut sim = Sim::new(seed * 104_729, TransferMode::Push, faults, 3, 10);
            sim.run();
            refused += sim.receiver.counters().notices_refused;
            sim.finish();
        }
    }
    assert!(refused > 0, "some notice should have come too late");
}
