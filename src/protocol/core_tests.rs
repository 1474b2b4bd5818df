//! Deterministic tests of the sans-IO protocol core: sender pull bookkeeping,
//! breaker, receiver key store, and the races between them. Time is a base
//! `Instant` plus `Duration`s; memory comes from real [`PagePool`]s, and
//! every test that allocates checks the pool is back at its start.

use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::*;
use crate::channel::{GrantId, GrantTag};
use crate::memory::{
    BufferRef, ChunkLayout, ChunkMeta, Dtype, MemFormat, MemObj, MemoryError, PagePool, PoolStats,
    RegisteredBuffer, SealedMemObj,
};

// ------------------------------------------------------------------ helpers

/// 16-byte pages: [2, 1, 4, 2] int8.
fn layout() -> ChunkLayout {
    ChunkLayout {
        fmt: MemFormat::Kv2Ltd,
        layers: 1,
        tokens: 4,
        hidden: 2,
        dtype: Dtype::Int8,
    }
}

fn pool(pages: usize) -> Arc<PagePool> {
    let page = layout().page_bytes();
    PagePool::new(RegisteredBuffer::host(pages * page, page, false).unwrap())
}

fn alloc(pool: &Arc<PagePool>, n: usize) -> Vec<SealedMemObj> {
    pool.allocate_batch(&vec![ChunkMeta::full(layout()); n])
        .unwrap()
        .into_iter()
        .map(MemObj::seal)
        .collect()
}

/// The pool holds nothing: no page allocated, pinned or quarantined.
fn assert_idle(pool: &PagePool) {
    let s = pool.stats();
    assert_eq!(
        (s.allocated, s.pinned, s.quarantined, s.free),
        (0, 0, 0, s.total),
        "pool not back at start: {s:?}"
    );
}

fn stats(pool: &PagePool) -> (usize, usize) {
    let PoolStats {
        allocated, pinned, ..
    } = pool.stats();
    (allocated, pinned)
}

fn ack(already: &[u64], failed: bool) -> PullReadyDoneAck {
    PullReadyDoneAck {
        already_sent_indexes: already.to_vec(),
        alloc_failed: failed,
    }
}

const TTL: Duration = Duration::from_secs(360);
const LEASE: Duration = Duration::from_secs(30);
const S: Duration = Duration::from_secs(1);

fn pending() -> PullPending {
    PullPending::default()
}

fn keys(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn receiver() -> ReceiverCore {
    ReceiverCore::new(ReceiverConfig {
        layout: layout(),
        push_landing_timeout: Duration::from_secs(5),
        read_margin_pct: 10.0,
        resident_ttl: None,
    })
}

/// The read margin of [`receiver`] for [`LEASE`].
fn margin() -> Duration {
    read_margin(LEASE, 10.0)
}

/// The request route of the test's writer, another socket of the same
/// writer, and a route of another writer.
const ROUTE: &str = "prefill:7600/p1r0-00000001#1";
const ROUTE_NEXT: &str = "prefill:7600/p1r0-00000001#2";
const OTHER_WRITER: &str = "prefill:7601/p2r0-00000002#1";

fn alloc_request(k: &[&str], last: u64) -> AllocRequest {
    AllocRequest {
        keys: keys(k),
        fmt: FMT_KV_2LTD,
        shape: vec![2, 1, 4, 2],
        dtype: "int8".into(),
        last_chunk_toks: last,
        ..Default::default()
    }
}

/// What the shell does with an `AllocRequest`: plan, allocate with
/// `alloc`, commit with `grant`.
fn push_with<F>(
    ks: &mut ReceiverCore,
    req: &AllocRequest,
    route: &str,
    t: Instant,
    alloc: F,
    grant: Option<GrantId>,
) -> PushReply
where
    F: FnOnce(&[ChunkMeta]) -> Result<Vec<MemObj>, MemoryError>,
{
    match ks.plan_push(t, route, req) {
        Err(reply) => *reply,
        Ok(plan) => {
            let pages = plan.check_pages(alloc(plan.metas()));
            ks.commit_push(t, plan, pages.map(|p| (p, grant)))
        }
    }
}

/// A push from [`ROUTE`] with pages of `pool`, granted as [`GRANT`].
fn push(ks: &mut ReceiverCore, req: &AllocRequest, t: Instant, pool: &Arc<PagePool>) -> PushReply {
    push_with(ks, req, ROUTE, t, |m| pool.allocate_batch(m), Some(GRANT))
}

/// The grant [`push`] makes.
const GRANT: GrantId = GrantId(1000);

/// The pages a push response lent.
fn refs_of(r: &AscendAllocResponse) -> Vec<BufferRef> {
    r.remote_indexes
        .iter()
        .zip(&r.remote_buffer_uuids)
        .map(|(&page, u)| BufferRef {
            uuid: Uuid::parse_str(u).unwrap(),
            page: page as u32,
        })
        .collect()
}

/// A notice received on `from`, ending route `route`'s allocation of
/// `refs`; the channel says nobody touches the pages any more.
fn notice(
    ks: &mut ReceiverCore,
    from: &str,
    route: &str,
    outcome: PushOutcome,
    refs: &[BufferRef],
    t: Instant,
) -> NoticeReply {
    ks.on_push_notice(
        t,
        from,
        &PushNotice {
            route: route.to_string(),
            outcome,
            refs: refs.to_vec(),
        },
        |_| true,
    )
}

/// The node of the pull sender in [`notif`] and [`remote_notif`].
const SENDER: &str = "prefill:7600";

/// The route a notification from [`SENDER`] comes on.
const SENDER_ROUTE: &str = "prefill:7600#0";

/// A pull id whose lease ends at `deadline` on the receiver's clock.
fn lease_id(deadline: Instant) -> String {
    PullId::new(lease::wire_micros(deadline)).encode()
}

/// A notification advertising `pages` of a sender pool under `k`.
fn notif(pull_id: &str, k: &[&str], pages: &[SealedMemObj]) -> PullReadyNotif {
    PullReadyNotif {
        pull_id: pull_id.into(),
        keys: keys(k),
        sender_buffer_uuids: pages
            .iter()
            .map(|p| p.buffer_ref().uuid.simple().to_string())
            .collect(),
        sender_mem_indexes: pages.iter().map(|p| u64::from(p.page())).collect(),
        sender_id: SENDER.into(),
        sender_done_url: "127.0.0.1:7700".into(),
        fmt: FMT_KV_2LTD,
        shape: vec![2, 1, 4, 2],
        dtype: "int8".into(),
        last_chunk_toks: 4,
        ..Default::default()
    }
}

/// A notification for remote pages that need not exist locally.
fn remote_notif(pull_id: &str, k: &[&str]) -> PullReadyNotif {
    let u = Uuid::new_v4().simple().to_string();
    PullReadyNotif {
        pull_id: pull_id.into(),
        keys: keys(k),
        sender_buffer_uuids: vec![u; k.len()],
        sender_mem_indexes: (0..k.len() as u64).collect(),
        sender_id: SENDER.into(),
        sender_done_url: "127.0.0.1:7700".into(),
        fmt: FMT_KV_2LTD,
        shape: vec![2, 1, 4, 2],
        dtype: "int8".into(),
        last_chunk_toks: 4,
        ..Default::default()
    }
}

/// What the shell does with a pull-eager notification from an attached
/// sender (agreed lease [`LEASE`]).
fn eager(ks: &mut ReceiverCore, n: &PullReadyNotif, t: Instant, pool: &Arc<PagePool>) -> PullReply {
    match ks.plan_pull(t, SENDER_ROUTE, n, Some(LEASE)) {
        Err(reply) => *reply,
        Ok(plan) => {
            let pages = pool.allocate_batch(plan.metas());
            ks.commit_pull_eager(plan, pages)
        }
    }
}

/// What the shell does with a pull-delay notification.
fn delay(ks: &mut ReceiverCore, n: &PullReadyNotif, t: Instant) -> PullReply {
    match ks.plan_pull(t, SENDER_ROUTE, n, Some(LEASE)) {
        Err(reply) => *reply,
        Ok(plan) => ks.commit_pull_delay(plan),
    }
}

// ============================================================ sender side

#[test]
fn insert_pins_and_done_releases_every_page() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut pp = pending();
    let pages = alloc(&pool, 3);
    assert!(matches!(
        pp.insert("p1", "r:7400", "req1", pages, t0, LEASE, None)
            .unwrap(),
        InsertOutcome::Pending
    ));
    assert_eq!(stats(&pool), (3, 3));
    assert_eq!(pp.pinned_pages(), 3);
    assert!(matches!(
        pp.on_ack("p1", &ack(&[], false), t0 + S),
        AckOutcome::Accepted {
            unpinned_early: 0,
            still_pinned: 3,
            invalid_indexes: 0
        }
    ));
    match pp.on_done("p1", t0 + 2 * S) {
        DoneOutcome::Released(r) => {
            assert_eq!((r.pull_id.as_str(), r.req_id.as_str()), ("p1", "req1"));
            assert_eq!(r.peer, "r:7400");
            assert_eq!(r.reason, ReleaseReason::Done);
            assert!(r.acked);
            assert_eq!(r.pages.len(), 3);
            assert!(r.pages.iter().all(|p| !p.is_pinned()));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(pp.pinned_pages(), 0);
    assert!(pp.is_empty());
    assert_idle(&pool);
    let c = pp.counters();
    assert_eq!((c.inserted, c.done_released, c.pulls_pending), (1, 1, 0));
}

#[test]
fn race_done_before_ack() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut pp = pending();
    pp.insert("p1", "r", "q", alloc(&pool, 2), t0, LEASE, None)
        .unwrap();
    // The receiver's PUSH overtakes the REP reply.
    let DoneOutcome::Released(r) = pp.on_done("p1", t0 + S) else {
        panic!("done must release");
    };
    assert!(!r.acked);
    drop(r);
    assert_idle(&pool);
    // The late ack finds it released; nothing more happens.
    match pp.on_ack("p1", &ack(&[0], false), t0 + 2 * S) {
        AckOutcome::AlreadyReleased {
            reason: ReleaseReason::Done,
            alloc_failed: false,
        } => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(pp.counters().done_before_ack, 1);
    assert_idle(&pool);
}

#[test]
fn race_done_after_ttl_sweep_is_not_a_double_free() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut pp = pending();
    pp.insert("p1", "r", "q", alloc(&pool, 2), t0, LEASE, None)
        .unwrap();
    assert!(pp.sweep(t0 + TTL - S, TTL).is_empty());
    assert_eq!(stats(&pool), (2, 2));
    let swept = pp.sweep(t0 + TTL, TTL);
    assert_eq!(swept.len(), 1);
    assert_eq!(swept[0].pull_id, "p1");
    assert_eq!(swept[0].pages, 2);
    // Unpinned, and handed back to whoever must wait for the grant to settle.
    assert_eq!(stats(&pool), (2, 0));
    drop(swept);
    assert_idle(&pool);
    // The receiver's Done arrives after the sweep: recognised, nothing freed again.
    assert!(matches!(
        pp.on_done("p1", t0 + TTL + S),
        DoneOutcome::AlreadyReleased(ReleaseReason::Expired)
    ));
    let c = pp.counters();
    assert_eq!(
        (c.expired, c.done_already_released, c.done_early),
        (1, 1, 0)
    );
    assert_eq!(c.sweeps, 2);
    assert_idle(&pool);
}

#[test]
fn done_for_unknown_pull_is_early_and_matches_a_later_insert() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut pp = pending();
    assert!(matches!(pp.on_done("ghost", t0), DoneOutcome::Early));
    assert_eq!(pp.counters().early_done_size, 1);
    // An insert of that id is released at once: nothing pinned.
    match pp
        .insert("ghost", "r", "q", alloc(&pool, 2), t0 + S, LEASE, None)
        .unwrap()
    {
        InsertOutcome::AlreadyDone(r) => {
            assert_eq!(r.reason, ReleaseReason::EarlyDone);
            assert_eq!(r.pages.len(), 2);
            assert_eq!(stats(&pool), (2, 0));
        }
        other => panic!("{other:?}"),
    }
    assert!(!pp.contains("ghost"));
    assert_idle(&pool);
    let c = pp.counters();
    assert_eq!(
        (c.done_early, c.early_done_matched, c.early_done_size),
        (1, 1, 0)
    );
}

#[test]
fn early_done_expires_after_its_lifetime() {
    let t0 = Instant::now();
    let pool = pool(2);
    let limits = PullPendingLimits::default();
    let mut pp = PullPending::new(limits);
    pp.on_done("x", t0);
    let later = t0 + limits.early_done_lifetime;
    assert!(matches!(
        pp.insert("x", "r", "q", alloc(&pool, 1), later, LEASE, None)
            .unwrap(),
        InsertOutcome::Pending
    ));
    assert!(matches!(pp.on_done("x", later), DoneOutcome::Released(_)));
    assert_idle(&pool);
}

#[test]
fn duplicate_done_is_harmless_and_counted() {
    let t0 = Instant::now();
    let pool = pool(2);
    let mut pp = pending();
    pp.insert("p", "r", "q", alloc(&pool, 2), t0, LEASE, None)
        .unwrap();
    assert!(matches!(pp.on_done("p", t0), DoneOutcome::Released(_)));
    for _ in 0..3 {
        assert!(matches!(
            pp.on_done("p", t0 + S),
            DoneOutcome::AlreadyReleased(ReleaseReason::Done)
        ));
    }
    let c = pp.counters();
    assert_eq!((c.done_released, c.done_already_released), (1, 3));
    assert_eq!(c.early_done_size, 0);
    assert_idle(&pool);
}

#[test]
fn alloc_failed_ack_releases_pins_and_breaker_opens_then_closes() {
    let t0 = Instant::now();
    let backoff = Duration::from_secs(2);
    let pool = pool(4);
    let mut pp = pending();
    let mut breaker = CircuitBreaker::new();
    let peer = "decode:7400";
    assert!(breaker.allows(peer, t0));
    pp.insert("p", peer, "q", alloc(&pool, 3), t0, LEASE, None)
        .unwrap();
    let out = pp.on_ack("p", &ack(&[], true), t0 + S);
    assert!(out.opens_breaker());
    match out {
        AckOutcome::AllocFailed(r) => {
            assert_eq!(r.reason, ReleaseReason::AllocFailed);
            assert_eq!(r.peer, peer);
            assert_eq!(r.pages.len(), 3);
        }
        other => panic!("{other:?}"),
    }
    // Released at once: nothing pinned or allocated any more.
    assert_idle(&pool);
    breaker.open(peer, t0 + S, backoff);
    assert!(!breaker.allows(peer, t0 + S));
    assert!(!breaker.allows(peer, t0 + S + backoff - Duration::from_millis(1)));
    assert!(breaker.allows(peer, t0 + S + backoff));
    let (b, p) = (breaker.counters(), pp.counters());
    assert_eq!((b.opens, b.skips, b.closes), (1, 2, 1));
    assert_eq!(p.acks_alloc_failed, 1);
    assert_eq!(p.pinned_pages, 0);
    // A late Done for it is a duplicate, not an early one.
    assert!(matches!(
        pp.on_done("p", t0 + 2 * S),
        DoneOutcome::AlreadyReleased(ReleaseReason::AllocFailed)
    ));
}

#[test]
fn ack_already_sent_unpins_those_pages_early() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut pp = pending();
    pp.insert("p", "r", "q", alloc(&pool, 4), t0, LEASE, None)
        .unwrap();
    match pp.on_ack("p", &ack(&[1, 3, 3, 9], false), t0 + S) {
        AckOutcome::Accepted {
            unpinned_early,
            still_pinned,
            invalid_indexes,
        } => assert_eq!((unpinned_early, still_pinned, invalid_indexes), (2, 2, 1)),
        other => panic!("{other:?}"),
    }
    // The two unpinned pages were dropped by the table: back in the pool.
    assert_eq!(stats(&pool), (2, 2));
    assert_eq!(pp.pinned_pages(), 2);
    // A duplicate ack changes nothing.
    assert!(matches!(
        pp.on_ack("p", &ack(&[0], false), t0 + S),
        AckOutcome::DuplicateAck
    ));
    assert_eq!(pp.pinned_pages(), 2);
    let DoneOutcome::Released(r) = pp.on_done("p", t0 + 2 * S) else {
        panic!()
    };
    assert_eq!(r.pages.len(), 2);
    drop(r);
    assert_idle(&pool);
    assert_eq!(pp.counters().pages_unpinned_at_ack, 2);
}

#[test]
fn ack_with_every_key_already_sent_releases_the_pull() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut pp = pending();
    pp.insert("p", "r", "q", alloc(&pool, 2), t0, LEASE, None)
        .unwrap();
    assert!(matches!(
        pp.on_ack("p", &ack(&[0, 1], false), t0),
        AckOutcome::AllAlreadySent(ReleasedPull { ref pages, .. }) if pages.is_empty()
    ));
    assert_idle(&pool);
    assert!(matches!(
        pp.on_done("p", t0 + S),
        DoneOutcome::AlreadyReleased(ReleaseReason::AllAlreadySent)
    ));
    assert_eq!(pp.counters().released_all_already_sent, 1);
}

#[test]
fn ttl_sweep_respects_the_lease() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut pp = pending();
    let short_ttl = Duration::from_secs(1);
    let long_lease = Duration::from_secs(10);
    pp.insert("p", "r", "q", alloc(&pool, 2), t0, long_lease, None)
        .unwrap();
    // TTL passed, lease not: the receiver may still read, nothing released.
    assert!(pp.sweep(t0 + Duration::from_secs(5), short_ttl).is_empty());
    assert!(pp
        .sweep(t0 + long_lease - Duration::from_millis(1), short_ttl)
        .is_empty());
    assert_eq!(stats(&pool), (2, 2));
    assert_eq!(pp.next_expiry(short_ttl), Some(t0 + long_lease));
    assert_eq!(pp.sweep(t0 + long_lease, short_ttl).len(), 1);
    assert_idle(&pool);

    // TTL longer than the lease: released at the TTL.
    pp.insert("p2", "r", "q", alloc(&pool, 1), t0, long_lease, None)
        .unwrap();
    let ttl = Duration::from_secs(20);
    assert!(pp.sweep(t0 + Duration::from_secs(19), ttl).is_empty());
    assert_eq!(pp.sweep(t0 + ttl, ttl)[0].pull_id, "p2");
    assert_idle(&pool);
    assert_eq!(pp.next_expiry(ttl), None);
}

#[test]
fn req_failure_releases_only_when_the_notif_never_left() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut pp = pending();
    pp.insert("sent-not", "r", "q", alloc(&pool, 2), t0, LEASE, None)
        .unwrap();
    pp.insert("maybe", "r", "q", alloc(&pool, 2), t0, LEASE, None)
        .unwrap();
    pp.insert("maybe-done", "r", "q", alloc(&pool, 1), t0, LEASE, None)
        .unwrap();
    match pp.on_req_failed("sent-not", Delivery::NotSent, t0 + S) {
        ReqFailedOutcome::Released(r) => assert_eq!(r.reason, ReleaseReason::ReqFailed),
        other => panic!("{other:?}"),
    }
    assert_eq!(stats(&pool), (3, 3));
    // Delivery unknown: the receiver may read until the lease; held until then.
    match pp.on_req_failed("maybe", Delivery::Unknown, t0 + S) {
        ReqFailedOutcome::HeldUntilLease { until } => assert_eq!(until, t0 + LEASE),
        other => panic!("{other:?}"),
    }
    pp.on_req_failed("maybe-done", Delivery::Unknown, t0 + S);
    assert!(pp.sweep(t0 + LEASE - S, TTL).is_empty());
    assert_eq!(stats(&pool), (3, 3));
    // The receiver did get "maybe-done" and signals Done before the lease.
    assert!(matches!(
        pp.on_done("maybe-done", t0 + 2 * S),
        DoneOutcome::Released(_)
    ));
    assert_eq!(stats(&pool), (2, 2));
    // At the lease end (well before the TTL) the rest is released.
    let swept = pp.sweep(t0 + LEASE, TTL);
    assert_eq!(swept.len(), 1);
    assert_eq!(swept[0].pull_id, "maybe");
    drop(swept);
    assert_idle(&pool);
    assert!(matches!(
        pp.on_req_failed("maybe", Delivery::NotSent, t0 + LEASE),
        ReqFailedOutcome::Unknown
    ));
    let c = pp.counters();
    assert_eq!((c.req_failed_released, c.req_failed_held), (1, 2));
}

#[test]
fn early_done_set_is_bounded() {
    let t0 = Instant::now();
    let cap = 16;
    let mut pp = PullPending::new(PullPendingLimits {
        early_done_capacity: cap,
        ..PullPendingLimits::default()
    });
    for i in 0..cap * 10 {
        assert!(matches!(
            pp.on_done(&format!("{i:032x}"), t0),
            DoneOutcome::Early
        ));
        assert!(pp.counters().early_done_size <= cap);
    }
    assert_eq!(pp.counters().early_done_size, cap);
    assert_eq!(pp.counters().done_early, (cap * 10) as u64);
    // The youngest are the ones kept.
    let pool = pool(2);
    let youngest = format!("{:032x}", cap * 10 - 1);
    let oldest = format!("{:032x}", 0);
    assert!(matches!(
        pp.insert(&youngest, "r", "q", alloc(&pool, 1), t0, LEASE, None)
            .unwrap(),
        InsertOutcome::AlreadyDone(_)
    ));
    assert!(matches!(
        pp.insert(&oldest, "r", "q", alloc(&pool, 1), t0, LEASE, None)
            .unwrap(),
        InsertOutcome::Pending
    ));
    pp.on_done(&oldest, t0);
    assert_idle(&pool);
}

#[test]
fn insert_rejects_duplicate_and_empty_ids_without_pinning() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut pp = pending();
    pp.insert("p", "r", "q", alloc(&pool, 1), t0, LEASE, None)
        .unwrap();
    let dup = pp
        .insert("p", "r", "q", alloc(&pool, 2), t0, LEASE, None)
        .unwrap_err();
    assert_eq!(dup, InsertError::DuplicatePullId("p".into()));
    assert_eq!(dup.to_string(), "pull_id \"p\" is already pending");
    assert_eq!(
        pp.insert("", "r", "q", alloc(&pool, 1), t0, LEASE, None)
            .unwrap_err(),
        InsertError::EmptyPullId
    );
    // Only the first insert's page is held.
    assert_eq!(stats(&pool), (1, 1));
    pp.on_done("p", t0);
    assert_idle(&pool);
}

#[test]
fn ack_for_unknown_pull_still_reports_alloc_failed() {
    let t0 = Instant::now();
    let mut pp = pending();
    let out = pp.on_ack("nope", &ack(&[], true), t0);
    assert!(matches!(out, AckOutcome::Unknown { alloc_failed: true }));
    assert!(out.opens_breaker());
    assert!(!pp.on_ack("nope", &ack(&[], false), t0).opens_breaker());
}

// ========================================================== receiver side

#[test]
fn push_lends_pages_to_their_writer_until_its_landed_notice() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut ks = receiver();
    let reply = push(&mut ks, &alloc_request(&["a", "b", "c"], 3), t0, &pool);
    assert!(matches!(
        reply.verdict,
        Verdict::Accepted { new: 3, present: 0 }
    ));
    let r = &reply.response;
    assert!(!r.alloc_failed && r.already_sent_indexes.is_empty());
    assert_eq!(r.remote_indexes, vec![0, 1, 2]);
    let uuid = pool.uuid().simple().to_string();
    assert_eq!(
        r.remote_buffer_uuids,
        vec![uuid.clone(), uuid.clone(), uuid]
    );
    assert_eq!(stats(&pool), (3, 0));
    // Not landed: never handed to the load path as valid, never removable
    // (the page is the writer's until it reports).
    assert!(matches!(ks.get("a", t0), Lookup::NotReady));
    assert_eq!(ks.state("c"), Some(KeyState::PendingPush));
    assert!(ks.remove("a").is_none());
    let refs = refs_of(r);
    let landed = notice(&mut ks, ROUTE, ROUTE, PushOutcome::Landed, &refs, t0);
    assert_eq!((landed.result, landed.landed), (Ok(()), 3));
    match ks.get("a", t0) {
        Lookup::Resident(p) => assert_eq!(p.tokens(), 4),
        other => panic!("{other:?}"),
    }
    // The last chunk is partial (3 of 4 tokens).
    match ks.get("c", t0) {
        Lookup::Resident(p) => assert_eq!((p.tokens(), p.byte_len()), (3, 12)),
        other => panic!("{other:?}"),
    }
    let c = ks.counters();
    assert_eq!(
        (c.resident, c.pending_push, c.landed, c.allocations_pending),
        (3, 0, 3, 0)
    );
    // Removing resident keys returns their pages.
    for k in ["a", "b", "c"] {
        assert_eq!(ks.remove(k).unwrap().state, KeyState::Resident);
    }
    assert!(ks.remove("a").is_none());
    assert_idle(&pool);
}

/// Defect: the landed notice was not tied to its writer. Now a notice for
/// another writer's allocation, or naming other pages, is refused and
/// changes nothing; the writer's own notice still lands.
#[test]
fn a_notice_for_someone_elses_allocation_is_refused() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut ks = receiver();
    let a = push(&mut ks, &alloc_request(&["a"], 4), t0, &pool);
    let b = push_with(
        &mut ks,
        &alloc_request(&["b"], 4),
        OTHER_WRITER,
        t0,
        |m| pool.allocate_batch(m),
        Some(GRANT),
    );
    let (ra, rb) = (refs_of(&a.response), refs_of(&b.response));
    // The other writer names our allocation (its route, its pages): refused.
    let r = notice(&mut ks, OTHER_WRITER, ROUTE, PushOutcome::Landed, &ra, t0);
    assert!(r.result.unwrap_err().contains("another writer's"));
    // Our writer names its allocation with the other's pages: refused.
    let r = notice(&mut ks, ROUTE, ROUTE, PushOutcome::Landed, &rb, t0);
    assert!(r.result.unwrap_err().contains("not those of route"));
    // A route with nothing open: refused.
    let r = notice(
        &mut ks,
        ROUTE_NEXT,
        ROUTE_NEXT,
        PushOutcome::Landed,
        &ra,
        t0,
    );
    assert!(r.result.unwrap_err().contains("no open allocation"));
    assert_eq!(ks.state("a"), Some(KeyState::PendingPush));
    assert_eq!(ks.state("b"), Some(KeyState::PendingPush));
    assert_eq!(ks.counters().notices_refused, 3);
    // Each writer's own notice lands its own keys only.
    assert!(notice(
        &mut ks,
        OTHER_WRITER,
        OTHER_WRITER,
        PushOutcome::Landed,
        &rb,
        t0
    )
    .result
    .is_ok());
    assert_eq!(ks.state("a"), Some(KeyState::PendingPush));
    assert_eq!(ks.state("b"), Some(KeyState::Resident));
    // A notice may come from the writer's next socket (its reply was lost).
    assert!(
        notice(&mut ks, ROUTE_NEXT, ROUTE, PushOutcome::Aborted, &ra, t0)
            .result
            .is_ok()
    );
    assert!(!ks.contains("a"));
    // Repeating it (the reply was lost again) gets the same answer, no change.
    assert!(
        notice(&mut ks, ROUTE_NEXT, ROUTE, PushOutcome::Aborted, &ra, t0)
            .result
            .is_ok()
    );
    ks.remove("b");
    assert_idle(&pool);
}

#[test]
fn dedup_partition_counts_every_state_as_present() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut ks = receiver();
    // resident "r", pending push "pp", pending read "pr", proxy "px".
    let r1 = push(&mut ks, &alloc_request(&["r"], 4), t0, &pool);
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&r1.response),
        t0,
    );
    push(&mut ks, &alloc_request(&["pp"], 4), t0, &pool);
    let sender_pool = self::pool(4);
    let sp = alloc(&sender_pool, 1);
    let mut e = eager(
        &mut ks,
        &notif(&lease_id(t0 + LEASE), &["pr"], &sp),
        t0,
        &pool,
    );
    let read = e.read.take().unwrap();
    delay(&mut ks, &remote_notif(&lease_id(t0 + LEASE), &["px"]), t0);
    assert_eq!(ks.state("r"), Some(KeyState::Resident));
    assert_eq!(ks.state("pp"), Some(KeyState::PendingPush));
    assert_eq!(ks.state("pr"), Some(KeyState::PendingRead));
    assert_eq!(ks.state("px"), Some(KeyState::Proxy));

    let p = ks.partition(&keys(&["new0", "r", "pp", "new1", "pr", "px"]));
    assert_eq!(p.present, vec![1, 2, 4, 5]);
    assert_eq!(p.new, vec![0, 3]);

    // A push for the same keys allocates only the new ones and reports the rest.
    let before = stats(&pool).0;
    let reply = push_with(
        &mut ks,
        &alloc_request(&["new0", "r", "pp", "new1", "pr", "px"], 4),
        ROUTE_NEXT,
        t0,
        |m| pool.allocate_batch(m),
        Some(GRANT),
    );
    assert_eq!(reply.response.already_sent_indexes, vec![1, 2, 4, 5]);
    assert_eq!(reply.response.remote_indexes.len(), 2);
    assert_eq!(stats(&pool).0, before + 2);
    assert_eq!(ks.counters().dedup_hits, 4);
    assert!(ks.contains("new1"));

    // Everything ends: the read fails, the pushes abort, the rest is removed.
    let pull = read.pull_id.clone();
    drop(read);
    assert!(ks.on_read_complete(&pull, None).is_some());
    let pp_refs = vec![BufferRef {
        uuid: pool.uuid(),
        page: 1,
    }];
    assert!(
        notice(&mut ks, ROUTE, ROUTE, PushOutcome::Aborted, &pp_refs, t0)
            .result
            .is_ok()
    );
    notice(
        &mut ks,
        ROUTE_NEXT,
        ROUTE_NEXT,
        PushOutcome::Aborted,
        &refs_of(&reply.response),
        t0,
    );
    for k in ["r", "px"] {
        ks.remove(k).unwrap();
    }
    assert!(ks.is_empty());
    drop(sp);
    assert_idle(&pool);
    assert_idle(&sender_pool);
}

#[test]
fn push_rollback_on_alloc_failure_leaves_nothing() {
    let t0 = Instant::now();
    let pool = pool(2);
    let mut ks = receiver();
    // Three new keys, two pages: all or nothing.
    let reply = push(&mut ks, &alloc_request(&["a", "b", "c"], 4), t0, &pool);
    assert!(matches!(
        reply.verdict,
        Verdict::AllocFailed(MemoryError::Exhausted { .. })
    ));
    assert_eq!(
        reply.response,
        AscendAllocResponse {
            already_sent_indexes: vec![],
            remote_indexes: vec![],
            remote_buffer_uuids: vec![],
            alloc_failed: true
        }
    );
    assert!(ks.is_empty());
    assert_eq!(ks.counters().alloc_failures, 1);
    assert_idle(&pool);

    // An allocator returning the wrong number of pages is a failure too.
    let short = |_: &[ChunkMeta]| Ok(pool.allocate_batch(&[ChunkMeta::full(layout())]).unwrap());
    let reply = push_with(
        &mut ks,
        &alloc_request(&["a", "b"], 4),
        ROUTE,
        t0,
        short,
        Some(GRANT),
    );
    assert!(reply.response.alloc_failed);
    assert!(reply
        .verdict
        .to_string_lossy()
        .contains("returned 1 page(s) for 2"));
    assert!(ks.is_empty());
    assert_eq!(ks.counters().alloc_failures, 2);
    assert_idle(&pool);

    // A present key is kept across a failed message (it was not part of the rollback).
    let keep = push(&mut ks, &alloc_request(&["keep"], 4), t0, &pool);
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&keep.response),
        t0,
    );
    let reply = push(&mut ks, &alloc_request(&["keep", "x", "y"], 4), t0, &pool);
    assert!(reply.response.alloc_failed);
    assert_eq!(ks.len(), 1);
    assert_eq!(stats(&pool).0, 1);
    ks.remove("keep");
    assert_idle(&pool);
}

trait VerdictText {
    fn to_string_lossy(&self) -> String;
}

impl VerdictText for Verdict {
    fn to_string_lossy(&self) -> String {
        match self {
            Verdict::AllocFailed(e) => e.to_string(),
            Verdict::Rejected(e) => e.to_string(),
            Verdict::Accepted { .. } => "accepted".into(),
            Verdict::Withdrawn { req_id, .. } => format!("{req_id} withdrawn"),
        }
    }
}

#[test]
fn invalid_messages_are_rejected_without_allocating() {
    let t0 = Instant::now();
    let mut ks = receiver();
    let mut bad = alloc_request(&["a"], 4);
    bad.shape = vec![2, 1, 8, 2];
    let reply = ks.plan_push(t0, ROUTE, &bad).unwrap_err();
    assert!(reply.response.alloc_failed);
    assert!(matches!(
        reply.verdict,
        Verdict::Rejected(InvalidMessage::LayoutMismatch { .. })
    ));
    assert!(reply
        .verdict
        .to_string_lossy()
        .starts_with("AllocRequest.shape"));
    let reply = ks
        .plan_push(t0, ROUTE, &alloc_request(&["a", "a"], 4))
        .unwrap_err();
    assert!(reply
        .verdict
        .to_string_lossy()
        .contains("keys[1]: duplicate"));
    let reply = ks
        .plan_push(t0, ROUTE, &alloc_request(&["a"], 5))
        .unwrap_err();
    assert!(reply.verdict.to_string_lossy().contains("last_chunk_toks"));

    let mut n = remote_notif(&lease_id(t0 + LEASE), &["a", "b"]);
    n.sender_mem_indexes.pop();
    let reply = ks.plan_pull(t0, SENDER_ROUTE, &n, Some(LEASE)).unwrap_err();
    assert!(reply.ack.alloc_failed);
    assert!(reply.read.is_none() && reply.done.is_empty());
    assert!(reply
        .verdict
        .to_string_lossy()
        .contains("PullReadyNotif.sender_mem_indexes"));
    let mut n = remote_notif(&lease_id(t0 + LEASE), &["a"]);
    n.sender_buffer_uuids[0] = "zz".into();
    assert!(delay(&mut ks, &n, t0).ack.alloc_failed);
    let c = ks.counters();
    assert_eq!((c.rejected_alloc_requests, c.rejected_pull_notifs), (3, 2));
    assert!(ks.is_empty());
}

/// Defect: unlanded push pages were freed after a fixed timeout while the
/// writer could still write them. Now the keys go, the grant is revoked,
/// and the pages stay quarantined until the channel says the writer is
/// quiescent — or a late notice proves it. Pages that could not be granted
/// are never advertised.
#[test]
fn an_unlanded_push_is_revoked_and_quarantined_never_reused_early() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut ks = receiver();
    let timeout = ks.config().push_landing_timeout;
    let g1 = GrantId(1);
    let a = push_with(
        &mut ks,
        &alloc_request(&["a", "b"], 4),
        ROUTE,
        t0,
        |m| pool.allocate_batch(m),
        Some(g1),
    );
    // Another writer the shell could not grant to: refused, pages back.
    let ungranted = push_with(
        &mut ks,
        &alloc_request(&["c"], 4),
        OTHER_WRITER,
        t0 + 2 * S,
        |m| pool.allocate_batch(m),
        None,
    );
    assert!(ungranted.response.alloc_failed);
    assert!(matches!(
        ungranted.verdict,
        Verdict::Rejected(InvalidMessage::UnknownSender { .. })
    ));
    assert!(!ks.contains("c"));
    assert_eq!(stats(&pool).0, 2);
    assert!(ks
        .sweep(t0 + timeout - Duration::from_millis(1))
        .revoke
        .is_empty());
    let report = ks.sweep(t0 + timeout);
    let mut gone = report.reclaimed_pushes.clone();
    gone.sort();
    assert_eq!(gone, keys(&["a", "b"]));
    assert_eq!(report.revoke, vec![g1]);
    assert!(matches!(ks.get("a", t0), Lookup::Missing));
    // The pages are not free: quarantined, and nobody can have them.
    let s = pool.stats();
    assert_eq!((s.allocated, s.quarantined), (2, 2));
    assert_eq!(
        pool.allocate_batch(&[ChunkMeta::full(layout()); 3])
            .err()
            .map(|_| ()),
        Some(())
    );
    assert_eq!(ks.awaiting_quiescence(), vec![g1]);
    assert_eq!(ks.counters().allocations_quarantined, 1);
    // A landed notice now is too late: refused, but it proves the writer
    // is done, so once the channel agrees the pages come back.
    let mut released = Vec::new();
    let late = ks.on_push_notice(
        t0 + timeout,
        ROUTE,
        &PushNotice {
            route: ROUTE.into(),
            outcome: PushOutcome::Landed,
            refs: refs_of(&a.response),
        },
        |g| {
            released.push(g);
            true
        },
    );
    assert!(late.result.unwrap_err().contains("too late"));
    assert_eq!(released, vec![g1]);
    assert!(!ks.contains("a"));
    assert_eq!(ks.counters().reclaimed_pushes, 1);
    assert_idle(&pool);

    // Revoked and never noticed: only the channel's word brings them back.
    let g2 = GrantId(2);
    push_with(
        &mut ks,
        &alloc_request(&["d"], 4),
        ROUTE_NEXT,
        t0,
        |m| pool.allocate_batch(m),
        Some(g2),
    );
    assert_eq!(ks.sweep(t0 + timeout).revoke, vec![g2]);
    assert_eq!(pool.stats().quarantined, 1);
    assert_eq!(ks.on_quiescent(GrantId(99)), Settled::default());
    assert_eq!(
        ks.on_quiescent(g2),
        Settled {
            freed: 1,
            landed: 0
        }
    );
    assert!(ks.awaiting_quiescence().is_empty());
    assert_idle(&pool);
}

/// Defect (review): an `aborted` notice gave the pages back while the tcp
/// server could still be writing them for a request the writer had given
/// up on. A notice whose grant still has requests being served waits for
/// the channel: `aborted` frees the keys at once but keeps the pages
/// quarantined; `landed` makes the keys resident only then.
#[test]
fn a_notice_while_requests_are_still_served_waits_for_the_channel() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut ks = receiver();
    for (outcome, route, g) in [
        (PushOutcome::Aborted, ROUTE, GrantId(7)),
        (PushOutcome::Landed, ROUTE_NEXT, GrantId(8)),
    ] {
        let a = push_with(
            &mut ks,
            &alloc_request(&["k"], 4),
            route,
            t0,
            |m| pool.allocate_batch(m),
            Some(g),
        );
        let reply = ks.on_push_notice(
            t0,
            route,
            &PushNotice {
                route: route.into(),
                outcome,
                refs: refs_of(&a.response),
            },
            |_| false, // a request under the grant is still being served
        );
        assert_eq!(reply.result, Ok(()));
        assert_eq!(reply.landed, 0);
        assert_eq!(pool.stats().quarantined, 1);
        assert_eq!(ks.awaiting_quiescence(), vec![g]);
        match outcome {
            // The key may be pushed again at once; the page waits.
            PushOutcome::Aborted => assert!(!ks.contains("k")),
            PushOutcome::Landed => assert!(matches!(ks.get("k", t0), Lookup::NotReady)),
        }
        // The landing deadline does not touch an allocation that ended.
        assert!(ks
            .sweep(t0 + 10 * ks.config().push_landing_timeout)
            .revoke
            .is_empty());
        let settled = ks.on_quiescent(g);
        assert_eq!(pool.stats().quarantined, 0);
        match outcome {
            PushOutcome::Aborted => {
                assert_eq!(
                    settled,
                    Settled {
                        freed: 1,
                        landed: 0
                    }
                );
                assert_idle(&pool);
            }
            PushOutcome::Landed => {
                assert_eq!(
                    settled,
                    Settled {
                        freed: 0,
                        landed: 1
                    }
                );
                assert!(matches!(ks.get("k", t0), Lookup::Resident(_)));
            }
        }
    }
    assert!(ks.remove("k").is_some());
    assert_idle(&pool);
}

/// A writer that never saw its allocation (the reply was lost) gives it
/// back with an `aborted` notice naming no pages: the route's allocation is
/// freed at once. With nothing allocated on the route, it is a no-op; a
/// `landed` notice with no pages is still refused.
#[test]
fn an_aborted_notice_with_no_pages_frees_the_routes_unseen_allocation() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut ks = receiver();
    push(&mut ks, &alloc_request(&["a", "b"], 4), t0, &pool);
    assert_eq!(stats(&pool).0, 2);
    let r = notice(&mut ks, ROUTE, ROUTE, PushOutcome::Aborted, &[], t0);
    assert_eq!(r.result, Ok(()));
    assert!(!ks.contains("a") && !ks.contains("b"));
    assert_idle(&pool);
    // The notice overtook its request (they come on different sockets):
    // nothing to free yet, and the request is refused when it arrives.
    let r = notice(&mut ks, ROUTE, ROUTE_NEXT, PushOutcome::Aborted, &[], t0);
    assert_eq!(r.result, Ok(()));
    let late = push_with(
        &mut ks,
        &alloc_request(&["c"], 4),
        ROUTE_NEXT,
        t0,
        |m| pool.allocate_batch(m),
        Some(GRANT),
    );
    assert!(late.response.alloc_failed);
    assert!(matches!(
        late.verdict,
        Verdict::Rejected(InvalidMessage::RouteGivenUp { .. })
    ));
    assert_idle(&pool);
    // A route still in use keeps its allocation against a `landed` notice
    // with no pages, and against another writer's `aborted` one.
    const THIRD: &str = "prefill:7600/p1r0-00000001#3";
    push_with(
        &mut ks,
        &alloc_request(&["c"], 4),
        THIRD,
        t0,
        |m| pool.allocate_batch(m),
        Some(GRANT),
    );
    let r = notice(&mut ks, THIRD, THIRD, PushOutcome::Landed, &[], t0);
    assert!(r.result.is_err());
    let r = notice(&mut ks, OTHER_WRITER, THIRD, PushOutcome::Aborted, &[], t0);
    assert!(r.result.is_err());
    assert!(ks.contains("c"));
}

#[test]
fn pull_eager_ack_then_read_then_done_once() {
    let t0 = Instant::now();
    let sender_pool = pool(4);
    let recv_pool = pool(4);
    let mut ks = receiver();
    let sp = alloc(&sender_pool, 2);
    let id = lease_id(t0 + LEASE);
    let reply = eager(&mut ks, &notif(&id, &["a", "b"], &sp), t0, &recv_pool);
    assert_eq!(reply.ack, ack(&[], false));
    // No Done with the ack: it only comes from the read's completion.
    assert!(reply.done.is_empty());
    let read = reply.read.unwrap();
    assert_eq!(read.pull_id, id);
    // The lease ends where the sender said; reads start before the margin.
    let deadline = read.deadline;
    assert!(deadline.saturating_duration_since(t0 + LEASE) < Duration::from_micros(2));
    assert_eq!(read.read_by, deadline - margin());
    assert_eq!(read.items.len(), 2);
    assert_eq!(read.items[1].remote, sp[1].buffer_ref());
    assert_eq!(read.items[0].bytes, 16);
    assert!(matches!(ks.get("a", t0), Lookup::NotReady));
    assert_eq!(ks.counters().eager_reads_open, 1);
    let done = ks.on_read_complete(&id, Some(read.pages)).unwrap();
    assert_eq!(done.signal.pull_id, id);
    assert_eq!(done.done_url, "127.0.0.1:7700");
    assert!(ks.on_read_complete(&id, None).is_none());
    assert!(matches!(ks.get("b", t0), Lookup::Resident(_)));
    assert_eq!(ks.counters().dones_emitted, 1);
    ks.remove("a");
    ks.remove("b");
    drop(sp);
    assert_idle(&recv_pool);
    assert_idle(&sender_pool);
}

#[test]
fn pull_eager_failed_or_late_read_drops_keys_and_still_sends_done() {
    let t0 = Instant::now();
    let recv_pool = pool(4);
    let mut ks = receiver();
    let f = lease_id(t0 + LEASE);
    let reply = eager(&mut ks, &remote_notif(&f, &["a"]), t0, &recv_pool);
    drop(reply.read);
    assert!(ks.on_read_complete(&f, None).is_some());
    assert!(!ks.contains("a"));
    assert_idle(&recv_pool);

    // A read that never completes: the sweep gives up at the lease and sends Done.
    let g = lease_id(t0 + LEASE);
    let reply = eager(&mut ks, &remote_notif(&g, &["b", "c"]), t0, &recv_pool);
    let read = reply.read.unwrap();
    assert!(ks.sweep(t0 + LEASE - S).done.is_empty());
    let report = ks.sweep(t0 + LEASE + Duration::from_micros(2));
    assert_eq!(report.done.len(), 1);
    let mut failed = report.failed_reads.clone();
    failed.sort();
    assert_eq!(failed, keys(&["b", "c"]));
    // The read (the transfer) still holds the pages until it lets go.
    assert_eq!(stats(&recv_pool).0, 2);
    assert!(ks.on_read_complete(&g, Some(read.pages)).is_none());
    assert!(ks.is_empty());
    assert_eq!(ks.counters().failed_reads, 3);
    assert_idle(&recv_pool);

    // Nothing new to read: the Done rides with the reply, after the ack.
    let x = push(&mut ks, &alloc_request(&["x"], 4), t0, &recv_pool);
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&x.response),
        t0,
    );
    let reply = eager(
        &mut ks,
        &remote_notif(&lease_id(t0 + LEASE), &["x"]),
        t0,
        &recv_pool,
    );
    assert_eq!(reply.ack.already_sent_indexes, vec![0]);
    assert!(reply.read.is_none());
    assert_eq!(reply.done.len(), 1);
    ks.remove("x");
    // Alloc failure in eager mode: ack says so, nothing kept.
    let small = pool(1);
    let reply = eager(
        &mut ks,
        &remote_notif(&lease_id(t0 + LEASE), &["y", "z"]),
        t0,
        &small,
    );
    assert!(reply.ack.alloc_failed && reply.read.is_none());
    assert!(ks.is_empty());
    assert_idle(&small);
    assert_idle(&recv_pool);
}

/// Defect: the receiver started the lease when it read the notification
/// and its margin ignored the agreed lease. Now the deadline is the
/// sender's (carried in the pull id, capped at arrival + lease), the
/// margin a share of the agreed lease, and a notification that arrives too
/// late is refused, not read.
#[test]
fn the_read_window_comes_from_the_senders_lease_not_the_arrival() {
    let t0 = Instant::now();
    let mut ks = receiver();
    let short = Duration::from_secs(2);
    // The sender pinned at t0 with a 2 s lease; the notification waited
    // 1.5 s in our queue: the window still ends at t0 + 2 s.
    let n = remote_notif(&lease_id(t0 + short), &["a"]);
    let plan = ks
        .plan_pull(
            t0 + Duration::from_millis(1500),
            SENDER_ROUTE,
            &n,
            Some(short),
        )
        .unwrap();
    assert!(plan.deadline().saturating_duration_since(t0 + short) < Duration::from_micros(2));
    ks.commit_pull_delay(plan);
    // The margin is 10 % of the agreed 2 s, not a fixed 5 s.
    let read_by = t0 + short - read_margin(short, 10.0);
    assert!(matches!(
        ks.get("a", read_by - Duration::from_millis(5)),
        Lookup::Proxy(_)
    ));
    assert!(matches!(
        ks.get("a", read_by + Duration::from_millis(5)),
        Lookup::Expired
    ));
    // The same notification waiting 1.9 s arrives within the margin: refused.
    let late = remote_notif(&lease_id(t0 + short), &["b"]);
    let reply = ks
        .plan_pull(
            t0 + Duration::from_millis(1900),
            SENDER_ROUTE,
            &late,
            Some(short),
        )
        .unwrap_err();
    assert!(reply.ack.alloc_failed);
    assert!(matches!(
        reply.verdict,
        Verdict::Rejected(InvalidMessage::LeaseOver { .. })
    ));
    assert!(!ks.contains("b"));
    // A deadline further than the agreed lease is capped at arrival + lease.
    let far = remote_notif(&lease_id(t0 + Duration::from_secs(3600)), &["c"]);
    let plan = ks.plan_pull(t0, SENDER_ROUTE, &far, Some(short)).unwrap();
    assert_eq!(plan.deadline(), t0 + short);
    // No lease in the pull id, or no handshake: refused.
    let reply = ks
        .plan_pull(
            t0,
            SENDER_ROUTE,
            &remote_notif("plain-uuid", &["d"]),
            Some(short),
        )
        .unwrap_err();
    assert!(reply
        .verdict
        .to_string_lossy()
        .contains("no lease deadline"));
    let reply = ks
        .plan_pull(
            t0,
            SENDER_ROUTE,
            &remote_notif(&lease_id(t0 + short), &["d"]),
            None,
        )
        .unwrap_err();
    assert!(reply.verdict.to_string_lossy().contains("no handshake"));
    assert_eq!(ks.counters().rejected_pull_notifs, 3);
}

#[test]
fn pull_delay_lookups_and_pins_do_not_consume_proxies() {
    let t0 = Instant::now();
    let mut ks = receiver();
    let d = lease_id(t0 + LEASE);
    let reply = delay(&mut ks, &remote_notif(&d, &["a", "b"]), t0);
    assert_eq!(reply.ack, ack(&[], false));
    assert!(reply.done.is_empty() && reply.read.is_none());
    // Many lookups: still there.
    for _ in 0..3 {
        match ks.get("a", t0) {
            Lookup::Proxy(p) => {
                assert_eq!(p.byte_len(), 16);
                assert_eq!(p.handle.pull_id, d);
            }
            other => panic!("{other:?}"),
        }
    }
    let p = ks.begin_proxy_read("a", t0).unwrap();
    // Pinned for a read: still in the store, still a proxy, context untouched.
    assert_eq!(ks.state("a"), Some(KeyState::Proxy));
    assert_eq!(ks.context(&d).unwrap().outstanding(), 2);
    // A failed pin (not a proxy / missing) changes nothing either.
    assert!(matches!(
        ks.begin_proxy_read("zz", t0),
        Err(ProxyReadError::Missing(_))
    ));
    assert!(ks
        .end_proxy_read(&p.handle, ReadOutcome::Consumed)
        .is_none());
    assert!(!ks.contains("a"));
    // A repeated end is harmless.
    assert!(ks
        .end_proxy_read(&p.handle, ReadOutcome::Consumed)
        .is_none());
    let c = ks.counters();
    assert_eq!(
        (c.proxies, c.proxies_outstanding, c.contexts_open),
        (1, 1, 1)
    );
    // Evicting the last proxy resolves the pull: exactly one Done.
    let removed = ks.remove("b").unwrap();
    assert_eq!(removed.state, KeyState::Proxy);
    assert!(removed.page.is_none());
    assert_eq!(removed.done.unwrap().signal.pull_id, d);
    assert!(ks.context(&d).is_none());
    assert_eq!(ks.counters().dones_emitted, 1);
    assert_eq!(ks.counters().contexts_open, 0);
}

#[test]
fn pull_delay_done_exactly_once_across_consume_discard_mixes() {
    let t0 = Instant::now();
    let names = ["k0", "k1", "k2", "k3"];
    for mask in 0..16u32 {
        let mut ks = receiver();
        delay(&mut ks, &remote_notif(&lease_id(t0 + LEASE), &names), t0);
        let mut dones = 0;
        for (i, k) in names.iter().enumerate() {
            let d = if mask & (1 << i) != 0 {
                let p = ks.begin_proxy_read(k, t0).unwrap();
                let outcome = if i % 2 == 0 {
                    ReadOutcome::Consumed
                } else {
                    ReadOutcome::Failed
                };
                let d = ks.end_proxy_read(&p.handle, outcome);
                // Repeats never emit a second Done.
                assert!(ks
                    .end_proxy_read(&p.handle, ReadOutcome::Consumed)
                    .is_none());
                d
            } else {
                ks.remove(k).unwrap().done
            };
            dones += d.iter().count();
            assert!(ks.remove(k).is_none());
        }
        assert_eq!(dones, 1, "mask {mask}");
        assert!(ks.is_empty());
        assert!(ks.sweep(t0 + LEASE * 2).done.is_empty());
        assert_eq!(ks.counters().dones_emitted, 1);
    }
}

#[test]
fn eviction_during_a_proxy_read_defers_the_done() {
    let t0 = Instant::now();
    let mut ks = receiver();
    let d = lease_id(t0 + LEASE);
    delay(&mut ks, &remote_notif(&d, &["a"]), t0);
    let p = ks.begin_proxy_read("a", t0).unwrap();
    // Evicted while the read is in flight: gone from the store, but no Done
    // (the sender must keep its pages until the read ends).
    let removed = ks.remove("a").unwrap();
    assert!(removed.done.is_none());
    assert!(!ks.contains("a"));
    assert_eq!(ks.counters().proxies_outstanding, 1);
    let done = ks.end_proxy_read(&p.handle, ReadOutcome::Consumed).unwrap();
    assert_eq!(done.signal.pull_id, d);
    assert_eq!(ks.counters().contexts_open, 0);
}

#[test]
fn proxies_past_the_lease_are_expired_never_read() {
    let t0 = Instant::now();
    let mut ks = receiver();
    let d = lease_id(t0 + LEASE);
    let plan = ks
        .plan_pull(
            t0,
            SENDER_ROUTE,
            &remote_notif(&d, &["a", "b", "c"]),
            Some(LEASE),
        )
        .unwrap();
    let deadline = plan.deadline();
    ks.commit_pull_delay(plan);
    let b = ks.begin_proxy_read("b", t0).unwrap();
    let c = ks.begin_proxy_read("c", t0).unwrap();
    assert!(ks
        .end_proxy_read(&c.handle, ReadOutcome::Consumed)
        .is_none());
    // Within the read margin before the lease: reported expired, pins refused.
    let edge = deadline - margin();
    assert!(matches!(
        ks.get("a", edge - Duration::from_millis(1)),
        Lookup::Proxy(_)
    ));
    assert!(matches!(ks.get("a", edge), Lookup::Expired));
    assert!(matches!(
        ks.begin_proxy_read("a", edge),
        Err(ProxyReadError::LeaseExpired(_))
    ));
    // Sweep at the lease: "a" discarded; "b" is mid-read, so no Done yet.
    let report = ks.sweep(deadline);
    assert_eq!(report.expired_proxies, keys(&["a", "b"]));
    assert!(report.done.is_empty());
    assert!(ks.is_empty());
    // A second sweep does not count them again.
    assert!(ks.sweep(deadline + S).expired_proxies.is_empty());
    let done = ks.end_proxy_read(&b.handle, ReadOutcome::Failed).unwrap();
    assert_eq!(done.signal.pull_id, d);
    let c = ks.counters();
    assert_eq!(
        (c.expired_proxies, c.dones_emitted, c.contexts_open),
        (2, 1, 0)
    );
}

#[test]
fn expired_proxy_is_replaced_by_a_new_message_for_its_key() {
    let t0 = Instant::now();
    let pool = pool(2);
    let mut ks = receiver();
    let old = lease_id(t0 + LEASE);
    delay(&mut ks, &remote_notif(&old, &["a"]), t0);
    // Before the sweep ran, a push for "a" arrives after the lease.
    let reply = push(&mut ks, &alloc_request(&["a"], 4), t0 + LEASE, &pool);
    assert!(reply.response.already_sent_indexes.is_empty());
    assert_eq!(reply.response.remote_indexes.len(), 1);
    assert_eq!(reply.done.len(), 1);
    assert_eq!(reply.done[0].signal.pull_id, old);
    assert_eq!(ks.state("a"), Some(KeyState::PendingPush));
    assert!(ks.context(&old).is_none());
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Aborted,
        &refs_of(&reply.response),
        t0 + LEASE,
    );
    assert_idle(&pool);
}

#[test]
fn pull_delay_rejects_a_reused_pull_id_and_empty_pulls_are_done_at_once() {
    let t0 = Instant::now();
    let mut ks = receiver();
    let d = lease_id(t0 + LEASE);
    delay(&mut ks, &remote_notif(&d, &["a"]), t0);
    let reply = delay(&mut ks, &remote_notif(&d, &["b"]), t0);
    assert!(reply.ack.alloc_failed);
    assert!(reply
        .verdict
        .to_string_lossy()
        .contains("is already in use"));
    assert!(!ks.contains("b"));
    // Every key already present: no context, Done right after the ack.
    let e = lease_id(t0 + LEASE);
    let reply = delay(&mut ks, &remote_notif(&e, &["a"]), t0);
    assert_eq!(reply.ack.already_sent_indexes, vec![0]);
    assert_eq!(reply.done.len(), 1);
    assert!(ks.context(&e).is_none());
    assert_eq!(ks.counters().contexts_open, 1);
}

// ============================================================ both sides

/// One pull-eager transfer between a sender's pull table and a receiver
/// core, with the receiver's Done overtaking its ack, and an alloc failure
/// that opens the breaker.
#[test]
fn sender_and_receiver_cores_pull_eager_end_to_end() {
    let t0 = Instant::now();
    let sender_pool = pool(10);
    let recv_pool = pool(3);
    let mut pp = pending();
    let mut breaker = CircuitBreaker::new();
    let bp = Backpressure::new(sender_pool.stats().total, 20.0);
    assert_eq!(bp.high_water(), 8);
    let mut ks = receiver();
    let peer = "decode:7400";

    // Pull 1: two chunks.
    assert!(breaker.allows(peer, t0));
    assert_eq!(bp.check(pp.pinned_pages(), 2), Admission::Admit);
    let pages = alloc(&sender_pool, 2);
    let p1 = lease_id(t0 + LEASE);
    let n1 = notif(&p1, &["a", "b"], &pages);
    pp.insert(&p1, peer, "req1", pages, t0, LEASE, None)
        .unwrap();
    let reply = eager(&mut ks, &n1, t0, &recv_pool);
    let frame = reply.ack.encode();
    let read = reply.read.unwrap();
    // "Read": copy nothing, just complete.
    let done = ks.on_read_complete(&p1, Some(read.pages)).unwrap();
    // Done overtakes the ack on the wire.
    let sig = PullDoneSignal::decode(&done.signal.encode()).unwrap();
    assert!(matches!(
        pp.on_done(&sig.pull_id, t0 + S),
        DoneOutcome::Released(_)
    ));
    let ack1 = PullReadyDoneAck::decode(&frame).unwrap();
    assert!(matches!(
        pp.on_ack(&p1, &ack1, t0 + S),
        AckOutcome::AlreadyReleased { .. }
    ));
    assert_idle(&sender_pool);
    assert_eq!(stats(&recv_pool), (2, 0));

    // Pull 2: "a" is already there, "c" and "d" need 2 pages, the receiver has 1.
    let pages = alloc(&sender_pool, 3);
    let p2 = lease_id(t0 + 2 * S + LEASE);
    let n2 = notif(&p2, &["a", "c", "d"], &pages);
    pp.insert(&p2, peer, "req2", pages, t0 + 2 * S, LEASE, None)
        .unwrap();
    assert_eq!(bp.check(pp.pinned_pages(), 6), Admission::Wait);
    assert_eq!(bp.check(pp.pinned_pages(), 9), Admission::TooLarge);
    let reply = eager(&mut ks, &n2, t0 + 2 * S, &recv_pool);
    assert!(reply.ack.alloc_failed);
    let out = pp.on_ack(&p2, &reply.ack, t0 + 2 * S);
    assert!(out.opens_breaker());
    drop(out);
    breaker.open(peer, t0 + 2 * S, Duration::from_secs(2));
    assert_idle(&sender_pool);
    assert!(!breaker.allows(peer, t0 + 3 * S));
    assert!(breaker.allows(peer, t0 + 4 * S));
    // The receiver kept only pull 1's keys.
    assert_eq!(ks.len(), 2);
    assert_eq!(stats(&recv_pool), (2, 0));
    ks.remove("a");
    ks.remove("b");
    assert_idle(&recv_pool);
}

// ============================================================ sender core

fn sender_core(mode: crate::config::TransferMode, pool: &Arc<PagePool>) -> SenderCore {
    SenderCore::new(SenderConfig {
        node: "prefill:7600/p1r0-00000001".into(),
        done_url: "prefill:7600".into(),
        mode,
        layout: layout(),
        pools: [pool.uuid()].into_iter().collect(),
        pull_pending_ttl: TTL,
        alloc_fail_backoff_ttl: Duration::from_secs(2),
        backpressure: Backpressure::new(pool.stats().total, 25.0),
        reserve_pct: 25.0,
    })
}

fn spec(peer: &str) -> PutSpec {
    PutSpec {
        peer_key: peer.into(),
        req_id: "req".into(),
        is_last_prefill: true,
    }
}

fn attached(t: Instant) -> Attached {
    Attached {
        peer: crate::channel::PeerId(7),
        lease: LEASE,
        clock: ClockMap::measure(t, t, lease::wire_micros(t)),
        incarnation: 1,
    }
}

fn finish(a: PutAction) -> PutEnd {
    match a {
        PutAction::Finish(end) => end,
        other => panic!("expected the end of the put, got {other:?}"),
    }
}

#[test]
fn a_push_runs_connect_alloc_write_notice_on_one_route() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let (spool, rpool) = (pool(8), pool(8));
    let mut sc = sender_core(TransferMode::Push, &spool);
    let mut ks = receiver();
    let (mut put, a) = sc.begin_put(t0, spec("r:7400"), keys(&["a", "b"]), alloc(&spool, 2));
    assert!(matches!(a, PutAction::Connect));
    let a = sc.on_connected(&mut put, t0, Some(attached(t0)));
    let PutAction::Request { route, frame, kind } = a else {
        panic!("{a:?}")
    };
    assert_eq!(kind, RequestKind::AllocRequest);
    assert_eq!(route, sc.route("r:7400"));
    let req = AllocRequest::decode(&frame).unwrap();
    let reply = push_with(
        &mut ks,
        &req,
        &route,
        t0,
        |m| rpool.allocate_batch(m),
        Some(GRANT),
    );
    let a = sc.on_reply(
        &mut put,
        t0,
        Ok(Message::AscendAllocResponse(reply.response).encode()),
    );
    let PutAction::Write { ops, tag, .. } = a else {
        panic!("{a:?}")
    };
    assert_eq!(ops.len(), 2);
    assert_eq!(
        Some(tag),
        GrantTag::of_route(&route),
        "written under its route"
    );
    drop(ops);
    let a = sc.on_written(&mut put, t0, WriteEnd::Written);
    let PutAction::Request {
        route: r2,
        frame,
        kind,
    } = a
    else {
        panic!("{a:?}")
    };
    assert_eq!((kind, &r2), (RequestKind::PushNotice, &route));
    let n = PushNotice::decode(&frame).unwrap().unwrap();
    assert_eq!(n.route, route);
    let answer = ks.on_push_notice(t0, &r2, &n, |_| true);
    let end = finish(sc.on_reply(&mut put, t0, Ok(notice::encode_reply(&answer.result))));
    assert_eq!(
        end.result,
        Ok(PutOutcome::Pushed {
            written: 2,
            already_present: 0
        })
    );
    assert_eq!(end.proxy_notif.unwrap().req_id, "req");
    assert_eq!(ks.state("a"), Some(KeyState::Resident));
}

/// A write that failed and is over ends with an aborted notice (the
/// receiver frees the pages at once); one the channel still runs sends no
/// notice and replaces the attachment and the route.
#[test]
fn a_failed_push_write_aborts_and_an_abandoned_one_reattaches() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let spool = pool(8);
    for (end, notice_expected) in [(WriteEnd::Failed, true), (WriteEnd::Abandoned, false)] {
        let mut sc = sender_core(TransferMode::Push, &spool);
        let (mut put, _) = sc.begin_put(t0, spec("r:7400"), keys(&["a"]), alloc(&spool, 1));
        sc.on_connected(&mut put, t0, Some(attached(t0)));
        let route = sc.route("r:7400");
        let resp = AscendAllocResponse {
            already_sent_indexes: vec![],
            remote_indexes: vec![5],
            remote_buffer_uuids: vec![Uuid::new_v4().simple().to_string()],
            alloc_failed: false,
        };
        let a = sc.on_reply(
            &mut put,
            t0,
            Ok(Message::AscendAllocResponse(resp).encode()),
        );
        assert!(matches!(a, PutAction::Write { .. }), "{a:?}");
        drop(a);
        match sc.on_written(&mut put, t0, end) {
            PutAction::Request { frame, kind, .. } => {
                assert!(notice_expected);
                assert_eq!(kind, RequestKind::PushNotice);
                let n = PushNotice::decode(&frame).unwrap().unwrap();
                assert_eq!((n.outcome, n.route), (PushOutcome::Aborted, route.clone()));
                let end = finish(sc.on_reply(&mut put, t0, Ok(notice::encode_reply(&Ok(())))));
                assert_eq!(end.result, Err(PutFailure::Io));
            }
            PutAction::Finish(end) => {
                assert!(!notice_expected);
                assert_eq!(end.result, Err(PutFailure::Io));
                assert!(sc.attached("r:7400").is_none(), "re-attach next time");
                assert_ne!(sc.route("r:7400"), route, "a new request socket");
            }
            other => panic!("{other:?}"),
        }
    }
    assert_idle(&spool);
}

/// Review finding (tcp): the receiver serves a push write only under the
/// grant tagged with its allocation's route number, and a write the sender
/// gave up on may still arrive later. So a number must never name a later
/// allocation: a write that did not land ends its route, and links to
/// different receivers (or one receiver under two names) never share one.
#[test]
fn a_route_number_never_names_two_allocations() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let spool = pool(8);
    let mut sc = sender_core(TransferMode::Push, &spool);
    let mut seen = std::collections::HashSet::new();
    for peer in ["r:7400", "r2:7400", "r:7400", "r2:7400"] {
        for end in [WriteEnd::Failed, WriteEnd::Abandoned] {
            let (mut put, a) = sc.begin_put(t0, spec(peer), keys(&["a"]), alloc(&spool, 1));
            let a = match a {
                PutAction::Connect => sc.on_connected(&mut put, t0, Some(attached(t0))),
                other => other,
            };
            let PutAction::Request { route, kind, .. } = a else {
                panic!("{a:?}")
            };
            assert_eq!(kind, RequestKind::AllocRequest);
            let resp = AscendAllocResponse {
                already_sent_indexes: vec![],
                remote_indexes: vec![5],
                remote_buffer_uuids: vec![Uuid::new_v4().simple().to_string()],
                alloc_failed: false,
            };
            let a = sc.on_reply(
                &mut put,
                t0,
                Ok(Message::AscendAllocResponse(resp).encode()),
            );
            let PutAction::Write { ops, tag, .. } = a else {
                panic!("{a:?}")
            };
            drop(ops);
            assert_eq!(Some(tag), GrantTag::of_route(&route));
            assert!(
                seen.insert(tag),
                "{route}: its number named an earlier allocation"
            );
            if let PutAction::Request { .. } = sc.on_written(&mut put, t0, end) {
                finish(sc.on_reply(&mut put, t0, Ok(notice::encode_reply(&Ok(())))));
            }
            assert_ne!(
                Some(tag),
                GrantTag::of_route(&sc.route(peer)),
                "route ended"
            );
        }
    }
    assert_idle(&spool);
}

/// A notice whose reply is lost is sent again from the next socket (its
/// frame names the allocation's route); after the last attempt the put
/// fails.
#[test]
fn a_lost_notice_reply_is_retried_from_the_next_socket() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let (spool, rpool) = (pool(8), pool(8));
    let mut sc = sender_core(TransferMode::Push, &spool);
    let mut ks = receiver();
    let (mut put, _) = sc.begin_put(t0, spec("r:7400"), keys(&["a"]), alloc(&spool, 1));
    let PutAction::Request { route, frame, .. } = sc.on_connected(&mut put, t0, Some(attached(t0)))
    else {
        panic!()
    };
    let req = AllocRequest::decode(&frame).unwrap();
    let reply = push_with(
        &mut ks,
        &req,
        &route,
        t0,
        |m| rpool.allocate_batch(m),
        Some(GRANT),
    );
    sc.on_reply(
        &mut put,
        t0,
        Ok(Message::AscendAllocResponse(reply.response).encode()),
    );
    let PutAction::Request { frame, .. } = sc.on_written(&mut put, t0, WriteEnd::Written) else {
        panic!()
    };
    // The receiver handles it, the reply is lost.
    let n = PushNotice::decode(&frame).unwrap().unwrap();
    assert!(ks.on_push_notice(t0, &route, &n, |_| true).result.is_ok());
    let PutAction::Request {
        route: next,
        frame: again,
        kind,
    } = sc.on_reply(&mut put, t0, Err(Delivery::Unknown))
    else {
        panic!()
    };
    assert_eq!(kind, RequestKind::PushNotice);
    assert_ne!(next, route);
    assert_eq!(again, frame);
    // The repeat is answered as the first was.
    let n = PushNotice::decode(&again).unwrap().unwrap();
    let answer = ks.on_push_notice(t0, &next, &n, |_| true);
    let end = finish(sc.on_reply(&mut put, t0, Ok(notice::encode_reply(&answer.result))));
    assert!(matches!(
        end.result,
        Ok(PutOutcome::Pushed { written: 1, .. })
    ));
    assert_eq!(ks.state("a"), Some(KeyState::Resident));
    // Lost three times: the put fails. The link is still attached, so the
    // second put goes straight to its request.
    let (mut put, a) = sc.begin_put(t0, spec("r:7400"), keys(&["b"]), alloc(&spool, 1));
    let PutAction::Request { route, frame, .. } = a else {
        panic!("{a:?}")
    };
    let req = AllocRequest::decode(&frame).unwrap();
    let reply = push_with(
        &mut ks,
        &req,
        &route,
        t0,
        |m| rpool.allocate_batch(m),
        Some(GRANT),
    );
    sc.on_reply(
        &mut put,
        t0,
        Ok(Message::AscendAllocResponse(reply.response).encode()),
    );
    sc.on_written(&mut put, t0, WriteEnd::Written);
    let mut a = sc.on_reply(&mut put, t0, Err(Delivery::Unknown));
    for _ in 0..2 {
        assert!(matches!(a, PutAction::Request { .. }), "{a:?}");
        a = sc.on_reply(&mut put, t0, Err(Delivery::Unknown));
    }
    assert_eq!(finish(a).result, Err(PutFailure::Io));
}

/// Admission reserves the pages it admits: two puts in flight together
/// cannot both pass the mark (the check and the pin were apart before).
#[test]
fn backpressure_admission_reserves_so_concurrent_puts_cannot_overshoot() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let spool = pool(8); // 25 % reserve: 6 pages may be pinned
    let mut sc = sender_core(TransferMode::PullDelay, &spool);
    let (mut p1, a) = sc.begin_put(t0, spec("r"), keys(&["a", "b", "c", "d"]), alloc(&spool, 4));
    assert!(matches!(a, PutAction::Connect));
    let a = sc.on_connected(&mut p1, t0, Some(attached(t0)));
    assert!(matches!(a, PutAction::Grant { .. }), "{a:?}");
    // The first put has not pinned yet (its grant is being made)...
    let (mut p2, a) = sc.begin_put(t0, spec("r"), keys(&["e", "f", "g"]), alloc(&spool, 3));
    assert!(matches!(a, PutAction::WaitForPins { .. }), "{a:?}");
    assert_eq!(sc.counters().reserved_pages, 4);
    // ...and stays admitted once pinned; the second still waits, then gives up.
    let a = sc.on_granted(&mut p1, t0, Some(GrantId(1)));
    assert!(matches!(a, PutAction::Request { .. }), "{a:?}");
    assert_eq!(sc.counters().reserved_pages, 0);
    let a = sc.on_pins_released(&mut p2, t0 + S);
    assert!(matches!(a, PutAction::WaitForPins { .. }), "{a:?}");
    let end = finish(sc.on_pins_released(&mut p2, t0 + sender::BACKPRESSURE_WAIT));
    assert!(matches!(
        end.result,
        Err(PutFailure::Rejected(PutRejected::Backpressure(_)))
    ));
    drop((p1, p2));
}

#[test]
fn bad_puts_an_open_breaker_and_a_failed_handshake_end_the_put() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let spool = pool(8);
    let other = pool(1);
    let mut sc = sender_core(TransferMode::PullEager, &spool);
    let bad = |sc: &mut SenderCore, k: &[&str], c: Vec<SealedMemObj>| {
        let (_, a) = sc.begin_put(t0, spec("r"), keys(k), c);
        match finish(a).result {
            Err(PutFailure::Rejected(PutRejected::InvalidInput(m))) => m,
            other => panic!("{other:?}"),
        }
    };
    assert!(bad(&mut sc, &[], vec![]).contains("no keys"));
    assert!(bad(&mut sc, &["a"], alloc(&spool, 2)).contains("1 keys but 2 chunks"));
    assert!(bad(&mut sc, &["a", "a"], alloc(&spool, 2)).contains("repeated"));
    assert!(bad(&mut sc, &["a"], alloc(&other, 1)).contains("not a page of this sender's pools"));
    // A failed handshake: nothing attached, an I/O failure for the shell to report.
    let (mut put, _) = sc.begin_put(t0, spec("r"), keys(&["a"]), alloc(&spool, 1));
    assert_eq!(
        finish(sc.on_connected(&mut put, t0, None)).result,
        Err(PutFailure::Io)
    );
    // alloc_failed opens the breaker: the next put is skipped without a message.
    let (mut put, _) = sc.begin_put(t0, spec("r"), keys(&["a"]), alloc(&spool, 1));
    sc.on_connected(&mut put, t0, Some(attached(t0)));
    let PutAction::Request { .. } = sc.on_granted(&mut put, t0, Some(GrantId(3))) else {
        panic!()
    };
    let a = sc.on_reply(&mut put, t0, Ok(ack(&[], true).encode()));
    assert!(matches!(a, PutAction::ProbeIncarnation), "{a:?}");
    let end = finish(sc.on_probed(&mut put, t0, Some(1)));
    assert_eq!(end.result, Ok(PutOutcome::ReceiverAllocFailed));
    assert_eq!(sc.take_grant_releases(), vec![GrantId(3)]);
    let (_, a) = sc.begin_put(t0 + S, spec("r"), keys(&["b"]), alloc(&spool, 1));
    assert_eq!(finish(a).result, Ok(PutOutcome::SkippedBreakerOpen));
    assert!(matches!(
        sc.breaker_state("r", t0 + S),
        BreakerState::Open { .. }
    ));
    assert_idle(&spool);
    assert_idle(&other);
}

/// Review finding: `on_granted` took the reservation off twice when the
/// put ended right after the grant (a failed grant, a vanished link), an
/// overflow in debug builds and wrong backpressure in release.
#[test]
fn a_put_ending_at_its_grant_releases_its_reservation_once() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let spool = pool(8);
    let mut sc = sender_core(TransferMode::PullDelay, &spool);
    let (mut put, _) = sc.begin_put(t0, spec("r"), keys(&["a", "b"]), alloc(&spool, 2));
    let a = sc.on_connected(&mut put, t0, Some(attached(t0)));
    assert!(matches!(a, PutAction::Grant { .. }), "{a:?}");
    assert_eq!(sc.counters().reserved_pages, 2);
    assert_eq!(
        finish(sc.on_granted(&mut put, t0, None)).result,
        Err(PutFailure::Io)
    );
    assert_eq!(sc.counters().reserved_pages, 0);
    // The next put is admitted as if nothing had been reserved.
    let six = keys(&["c", "d", "e", "f", "g", "h"]);
    let (put, a) = sc.begin_put(t0, spec("r"), six, alloc(&spool, 6));
    assert!(matches!(a, PutAction::Grant { .. }), "{a:?}");
    drop(put);
}

/// An allocation the sender will not write (its reply was lost, or made
/// no sense) is given back at once with an `aborted` notice naming no
/// pages, on the allocation's route; the receiver frees it.
#[test]
fn an_allocation_the_sender_never_writes_is_given_back_at_once() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let (spool, rpool) = (pool(8), pool(8));
    for lose_reply in [true, false] {
        let mut ks = receiver();
        let mut sc = sender_core(TransferMode::Push, &spool);
        let (mut put, _) = sc.begin_put(t0, spec("r:7400"), keys(&["a"]), alloc(&spool, 1));
        let PutAction::Request { route, frame, .. } =
            sc.on_connected(&mut put, t0, Some(attached(t0)))
        else {
            panic!()
        };
        let req = AllocRequest::decode(&frame).unwrap();
        let reply = push_with(
            &mut ks,
            &req,
            &route,
            t0,
            |m| rpool.allocate_batch(m),
            Some(GRANT),
        );
        assert_eq!(stats(&rpool).0, 1);
        let a = if lose_reply {
            sc.on_reply(&mut put, t0, Err(Delivery::Unknown))
        } else {
            // Garbage where the response should be.
            let mut bad = reply.response.clone();
            bad.remote_buffer_uuids = vec!["not-a-uuid".into()];
            sc.on_reply(&mut put, t0, Ok(Message::AscendAllocResponse(bad).encode()))
        };
        let PutAction::Request {
            route: via,
            frame,
            kind,
        } = a
        else {
            panic!("{a:?}")
        };
        assert_eq!(kind, RequestKind::PushNotice);
        assert_ne!(via, route, "sent from the next socket");
        let n = PushNotice::decode(&frame).unwrap().unwrap();
        assert_eq!(
            (&n.route, n.outcome, n.refs.len()),
            (&route, PushOutcome::Aborted, 0)
        );
        let answer = ks.on_push_notice(t0, &via, &n, |_| true);
        assert_eq!(answer.result, Ok(()));
        assert!(!ks.contains("a"));
        assert_idle(&rpool);
        let end = finish(sc.on_reply(&mut put, t0, Ok(notice::encode_reply(&answer.result))));
        if lose_reply {
            assert_eq!(end.result, Err(PutFailure::Io));
        } else {
            assert!(
                matches!(
                    end.result,
                    Err(PutFailure::Rejected(PutRejected::BadReply { .. }))
                ),
                "{:?}",
                end.result
            );
            assert!(
                sc.attached("r:7400").is_none(),
                "a receiver that talks nonsense is re-attached"
            );
        }
    }
    assert_idle(&spool);
}

/// Review finding: after a receiver restarted (new pools, no attachment of
/// ours) every put failed for good. A failed write drops the attachment so
/// the next put attaches again; a refused allocation probes the receiver's
/// incarnation and keeps the attachment when the same process answers.
#[test]
fn a_failed_write_or_refused_allocation_makes_the_next_put_attach_again() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let spool = pool(8);
    let mut sc = sender_core(TransferMode::Push, &spool);
    let resp = |failed: bool| AscendAllocResponse {
        already_sent_indexes: vec![],
        remote_indexes: if failed { vec![] } else { vec![5] },
        remote_buffer_uuids: if failed {
            vec![]
        } else {
            vec![Uuid::new_v4().simple().to_string()]
        },
        alloc_failed: failed,
    };
    let (mut put, _) = sc.begin_put(t0, spec("r"), keys(&["a"]), alloc(&spool, 1));
    sc.on_connected(&mut put, t0, Some(attached(t0)));
    sc.on_reply(
        &mut put,
        t0,
        Ok(Message::AscendAllocResponse(resp(false)).encode()),
    );
    assert!(matches!(
        sc.on_written(&mut put, t0, WriteEnd::Failed),
        PutAction::Request { .. }
    ));
    assert!(sc.attached("r").is_none());
    let (mut put, a) = sc.begin_put(t0, spec("r"), keys(&["b"]), alloc(&spool, 1));
    assert!(matches!(a, PutAction::Connect), "{a:?}");
    sc.on_connected(&mut put, t0, Some(attached(t0)));
    // A refusal first probes the receiver's incarnation (no attach), to
    // tell a restart from a full pool.
    let a = sc.on_reply(
        &mut put,
        t0,
        Ok(Message::AscendAllocResponse(resp(true)).encode()),
    );
    assert!(matches!(a, PutAction::ProbeIncarnation), "{a:?}");
    // The same incarnation answers: the refusal stands, and the attachment
    // (with any read in flight under it) is kept.
    let end = finish(sc.on_probed(&mut put, t0, Some(1)));
    assert_eq!(end.result, Ok(PutOutcome::ReceiverAllocFailed));
    assert!(sc.attached("r").is_some());
    // After the backoff the put goes on without a new handshake.
    let (_, a) = sc.begin_put(t0 + 3 * S, spec("r"), keys(&["c"]), alloc(&spool, 1));
    assert!(matches!(a, PutAction::Request { .. }), "{a:?}");
    // A probe nobody answers: as before, attach again next time.
    let (mut put, _) = sc.begin_put(t0 + 6 * S, spec("r"), keys(&["d"]), alloc(&spool, 1));
    let a = sc.on_reply(
        &mut put,
        t0 + 6 * S,
        Ok(Message::AscendAllocResponse(resp(true)).encode()),
    );
    assert!(matches!(a, PutAction::ProbeIncarnation), "{a:?}");
    finish(sc.on_probed(&mut put, t0 + 6 * S, None));
    assert!(sc.attached("r").is_none());
}

/// Review finding: a notification's `sender_id` was taken on trust, so one
/// sender could make the receiver read another's pages. It must come on a
/// route of the sender it names.
#[test]
fn a_notification_from_someone_else_than_its_sender_is_refused() {
    let t0 = Instant::now();
    let mut ks = receiver();
    let n = remote_notif(&lease_id(t0 + LEASE), &["a"]);
    let reply = ks
        .plan_pull(t0, "intruder:1/p9r0-00000009#0", &n, Some(LEASE))
        .unwrap_err();
    assert!(reply.ack.alloc_failed);
    match &reply.verdict {
        Verdict::Rejected(e @ InvalidMessage::NotFromSender { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains("prefill:7600") && text.contains("intruder:1"),
                "{text}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(!ks.contains("a"));
    assert!(ks.plan_pull(t0, SENDER_ROUTE, &n, Some(LEASE)).is_ok());
}

/// Review finding: shutting down returned lent pages to the pool before
/// their grants were revoked. Now each grant is revoked first, and a page
/// whose writer may still write it stays quarantined for good.
#[test]
fn shutting_down_frees_only_pages_no_writer_can_touch() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut ks = receiver();
    let (quiet, busy) = (GrantId(1), GrantId(2));
    for (k, route, g) in [("a", ROUTE, quiet), ("b", ROUTE_NEXT, busy)] {
        push_with(
            &mut ks,
            &alloc_request(&[k], 4),
            route,
            t0,
            |m| pool.allocate_batch(m),
            Some(g),
        );
    }
    let mut revoked = Vec::new();
    let kept = ks.shut_down(|g| {
        revoked.push(g);
        g == quiet
    });
    revoked.sort_by_key(|g| g.0);
    assert_eq!(revoked, vec![quiet, busy]);
    assert_eq!(kept, 1);
    let s = pool.stats();
    assert_eq!((s.allocated, s.quarantined), (1, 1));
    assert!(ks.is_empty());
}

/// A sender may hold no more proxies here than it has pages: a
/// notification that would exceed the cap is refused by name and counted,
/// the proxies already stored stay, and once they are consumed the same
/// sender may announce again.
#[test]
fn a_sender_cannot_store_more_proxies_than_it_has_pages() {
    let t0 = Instant::now();
    let mut ks = receiver();
    let capped = |ks: &mut ReceiverCore, n: &PullReadyNotif| match ks.plan_pull(
        t0,
        SENDER_ROUTE,
        n,
        Some(LEASE),
    ) {
        Err(reply) => *reply,
        Ok(plan) => ks.commit_pull_delay_capped(plan, 3),
    };
    let first = capped(&mut ks, &remote_notif(&lease_id(t0 + LEASE), &["a", "b"]));
    assert!(matches!(first.verdict, Verdict::Accepted { new: 2, .. }));
    assert_eq!(ks.proxies_of(SENDER), 2);
    let over = capped(&mut ks, &remote_notif(&lease_id(t0 + LEASE), &["c", "d"]));
    match &over.verdict {
        Verdict::Rejected(e) => {
            let e = e.to_string();
            assert!(e.contains("2 + 2 proxies") && e.contains("cap of 3"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert!(over.ack.alloc_failed);
    assert_eq!(ks.counters().rejected_pull_notifs, 1);
    assert_eq!(ks.proxies_of(SENDER), 2);
    assert!(ks.contains("a") && !ks.contains("c"));
    // One more still fits.
    let one = capped(&mut ks, &remote_notif(&lease_id(t0 + LEASE), &["c"]));
    assert!(matches!(one.verdict, Verdict::Accepted { new: 1, .. }));
    // Consumed proxies free their share of the cap.
    for k in ["a", "b", "c"] {
        ks.remove(k);
    }
    assert_eq!(ks.proxies_of(SENDER), 0);
    let again = capped(
        &mut ks,
        &remote_notif(&lease_id(t0 + LEASE), &["d", "e", "f"]),
    );
    assert!(matches!(again.verdict, Verdict::Accepted { new: 3, .. }));
}

/// A proxy the sweep discarded at its lease's end is reported as expired,
/// not as never stored, to a load that comes after the sweep (the load
/// used to say "not stored" or "lease expired" depending on who came
/// first); removing the key forgets it.
#[test]
fn a_proxy_swept_at_its_lease_end_still_looks_expired_to_a_late_load() {
    let t0 = Instant::now();
    let mut ks = receiver();
    let n = remote_notif(&lease_id(t0 + LEASE), &["late"]);
    assert!(matches!(
        delay(&mut ks, &n, t0).verdict,
        Verdict::Accepted { new: 1, .. }
    ));
    let after = t0 + LEASE + S;
    assert!(matches!(ks.get("late", after), Lookup::Expired));
    let swept = ks.sweep(after);
    assert_eq!(swept.expired_proxies, ["late"]);
    assert!(!ks.contains("late"));
    assert!(matches!(ks.get("late", after), Lookup::Expired));
    assert!(ks.remove("late").is_none());
    assert!(matches!(ks.get("late", after), Lookup::Missing));
    assert!(matches!(ks.get("never", after), Lookup::Missing));
}

/// A notification that waited for pages keeps the lease cap of its
/// arrival: a far-off deadline in the pull id cannot be stretched by the
/// wait.
#[test]
fn a_pull_that_waited_for_pages_keeps_the_lease_cap_of_its_arrival() {
    let t0 = Instant::now();
    let mut ks = receiver();
    let n = remote_notif(&lease_id(t0 + 10 * LEASE), &["k"]);
    let plan = ks
        .plan_pull_since(t0 + 5 * S, t0, SENDER_ROUTE, &n, Some(LEASE))
        .unwrap();
    assert_eq!(plan.deadline(), t0 + LEASE);
    // Arriving now, it would get the full lease from now.
    let n = remote_notif(&lease_id(t0 + 10 * LEASE), &["k2"]);
    let plan = ks
        .plan_pull(t0 + 5 * S, SENDER_ROUTE, &n, Some(LEASE))
        .unwrap();
    assert_eq!(plan.deadline(), t0 + 5 * S + LEASE);
}

// ============================================================ CancelNotif

/// A cancel drops resident keys now and marks keys still being pushed: when
/// their writer's landed notice comes, they are dropped instead of stored,
/// and every page is back. Keys of another request are untouched, and the
/// same keys may be pushed afresh afterwards.
#[test]
fn cancel_drops_resident_keys_now_and_pushed_keys_when_they_land() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut ks = receiver();
    let r1 = push(&mut ks, &alloc_request(&["a", "b"], 4), t0, &pool);
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&r1.response),
        t0,
    );
    let r2 = push(&mut ks, &alloc_request(&["c", "other"], 4), t0, &pool);
    assert_eq!(ks.state("c"), Some(KeyState::PendingPush));

    let c = ks.cancel(t0, "r", &keys(&["a", "b", "c", "never-stored"]));
    assert_eq!(
        c.removed
            .iter()
            .map(|(k, _)| k.as_str())
            .collect::<Vec<_>>(),
        vec!["a", "b"]
    );
    assert_eq!(c.deferred, vec!["c".to_string()]);
    drop(c);
    assert_eq!(
        stats(&pool),
        (2, 0),
        "a and b are back; c and other still lent"
    );
    // The writer finishes: "c" is dropped, "other" (not cancelled) lands.
    let landed = notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&r2.response),
        t0,
    );
    assert_eq!(landed.result, Ok(()));
    assert_eq!(ks.state("c"), None);
    assert_eq!(ks.state("other"), Some(KeyState::Resident));
    assert_eq!(ks.counters().cancelled_keys, 3);
    assert_eq!(stats(&pool), (1, 0));
    // A new request may push "c" again: the mark was used up.
    let r3 = push(&mut ks, &alloc_request(&["c"], 4), t0, &pool);
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&r3.response),
        t0,
    );
    assert_eq!(ks.state("c"), Some(KeyState::Resident));
    ks.remove("c");
    ks.remove("other");
    assert_idle(&pool);
}

/// A cancel while a pull-eager read runs drops the keys when the read
/// ends, and the pull's Done still goes out exactly once.
#[test]
fn cancel_during_an_eager_read_drops_its_pages_and_still_sends_done() {
    let t0 = Instant::now();
    let sender_pool = pool(4);
    let recv_pool = pool(4);
    let mut ks = receiver();
    let sp = alloc(&sender_pool, 2);
    let id = lease_id(t0 + LEASE);
    let reply = eager(&mut ks, &notif(&id, &["a", "b"], &sp), t0, &recv_pool);
    let read = reply.read.unwrap();
    let c = ks.cancel(t0, "r", &keys(&["a", "b"]));
    assert!(c.removed.is_empty());
    assert_eq!(c.deferred.len(), 2);
    let done = ks.on_read_complete(&id, Some(read.pages)).unwrap();
    assert_eq!(done.signal.pull_id, id);
    assert_eq!((ks.state("a"), ks.state("b")), (None, None));
    drop(sp);
    assert_idle(&recv_pool);
    assert_idle(&sender_pool);
}

/// Cancelling a pull-delay request discards its proxies: once the last of a
/// pull's proxies is gone its Done is returned, so the sender unpins.
#[test]
fn cancel_discards_proxies_and_returns_the_pulls_done() {
    let t0 = Instant::now();
    let sender_pool = pool(4);
    let mut ks = receiver();
    let sp = alloc(&sender_pool, 2);
    let id = lease_id(t0 + LEASE);
    delay(&mut ks, &notif(&id, &["a", "b"], &sp), t0);
    let first = ks.cancel(t0, "r", &keys(&["a"]));
    assert!(first.removed[0].1.done.is_none(), "b still needs the pull");
    let second = ks.cancel(t0, "r", &keys(&["b"]));
    let done = second.removed[0].1.done.as_ref().expect("the pull's Done");
    assert_eq!(done.signal.pull_id, id);
    assert_eq!(ks.counters().proxies, 0);
}

/// The decoder cache probe names the keys held in any state, with their
/// positions in the query.
#[test]
fn a_cache_query_names_held_keys_by_position() {
    let t0 = Instant::now();
    let sender_pool = pool(2);
    let pool = pool(8);
    let mut ks = receiver();
    let r = push(&mut ks, &alloc_request(&["landed"], 4), t0, &pool);
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&r.response),
        t0,
    );
    push(&mut ks, &alloc_request(&["landing"], 4), t0, &pool);
    let sp = alloc(&sender_pool, 1);
    delay(&mut ks, &notif(&lease_id(t0 + LEASE), &["proxy"], &sp), t0);
    let q = ks.query(&keys(&["nope", "landed", "landing", "x", "proxy"]));
    assert_eq!(q.cached_keys, keys(&["landed", "landing", "proxy"]));
    assert_eq!(q.cached_indexes, vec![1, 2, 4]);
    assert!(ks.query(&[]).cached_keys.is_empty());
}

// ==================================================== withdrawn requests

/// A receiver whose landed chunks wait `ttl` to be loaded (and whose
/// cancelled requests stay withdrawn that long).
fn receiver_with_ttl(ttl: Duration) -> ReceiverCore {
    ReceiverCore::new(ReceiverConfig {
        resident_ttl: Some(ttl),
        ..*receiver().config()
    })
}

/// The decode gave up on request "p1" before any of its chunks came: the
/// prefill's AllocRequest for it, arriving later, is answered with every
/// key already sent and takes no page, so the sender writes nothing and
/// its put ends. The same keys under another request, or with no request
/// id (LMCache-Ascend), are stored as before.
#[test]
fn a_push_of_a_request_cancelled_before_it_came_takes_no_page_and_writes_nothing() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let (spool, rpool) = (pool(8), pool(8));
    let mut ks = receiver_with_ttl(Duration::from_secs(600));
    let c = ks.cancel(t0, "p1", &keys(&["a", "b"]));
    assert!(c.removed.is_empty() && c.deferred.is_empty(), "{c:?}");

    // The prefill's put of "p1", through the sender core.
    let mut sc = sender_core(TransferMode::Push, &spool);
    let p1 = PutSpec {
        req_id: "p1".into(),
        ..spec("r:7400")
    };
    let (mut put, _) = sc.begin_put(t0 + S, p1, keys(&["a", "b"]), alloc(&spool, 2));
    let PutAction::Request { route, frame, .. } =
        sc.on_connected(&mut put, t0 + S, Some(attached(t0)))
    else {
        panic!("an AllocRequest")
    };
    let req = AllocRequest::decode(&frame).unwrap();
    assert_eq!(req.req_id.as_deref(), Some("p1"));
    let reply = push_with(
        &mut ks,
        &req,
        &route,
        t0 + S,
        |m| rpool.allocate_batch(m),
        Some(GRANT),
    );
    assert_eq!(
        reply.response,
        AscendAllocResponse {
            already_sent_indexes: vec![0, 1],
            remote_indexes: vec![],
            remote_buffer_uuids: vec![],
            alloc_failed: false,
        }
    );
    assert!(
        matches!(&reply.verdict, Verdict::Withdrawn { req_id, keys: 2 } if req_id == "p1"),
        "{:?}",
        reply.verdict
    );
    assert_idle(&rpool);
    assert!(ks.is_empty());
    assert_eq!(ks.counters().withdrawn_keys, 2);
    assert_eq!(ks.counters().allocations_pending, 0);
    let end = finish(sc.on_reply(
        &mut put,
        t0 + S,
        Ok(Message::AscendAllocResponse(reply.response).encode()),
    ));
    assert_eq!(
        end.result,
        Ok(PutOutcome::Pushed {
            written: 0,
            already_present: 2
        })
    );
    drop(put);
    assert_idle(&spool);

    // Another request with the same keys is stored and lands.
    let r2 = push(&mut ks, &alloc_for("p2", &["a", "b"]), t0 + S, &rpool);
    assert!(r2.response.already_sent_indexes.is_empty());
    assert_eq!(r2.response.remote_indexes.len(), 2);
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&r2.response),
        t0 + S,
    );
    assert!(matches!(ks.get("a", t0 + S), Lookup::Resident(_)));
    // A later batch of "p1" finds them present either way: no hold for it.
    let again = push(&mut ks, &alloc_for("p1", &["a", "b", "c"]), t0 + S, &rpool);
    assert_eq!(again.response.already_sent_indexes, vec![0, 1, 2]);
    assert_eq!(ks.holders("a"), 1);
    assert_eq!(ks.counters().withdrawn_keys, 5);
    ks.release("p2", "a").unwrap();
    ks.release("p2", "b").unwrap();
    // Without a request id nothing is withdrawn.
    let anon = push(&mut ks, &alloc_request(&["a"], 4), t0 + S, &rpool);
    assert_eq!(anon.response.remote_indexes.len(), 1);
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&anon.response),
        t0 + S,
    );
    ks.remove("a");
    assert_idle(&rpool);
}

/// A withdrawn request is remembered for `pd_resident_ttl` (600 s when
/// chunks never expire), no longer: after that its keys are stored again.
#[test]
fn a_withdrawn_request_is_forgotten_after_its_lifetime() {
    let ttl = Duration::from_secs(60);
    for (mut ks, life) in [
        (receiver_with_ttl(ttl), ttl),
        (receiver(), Duration::from_secs(600)),
    ] {
        let t0 = Instant::now();
        let pool = pool(4);
        ks.cancel(t0, "p1", &keys(&["a"]));
        let before = push(&mut ks, &alloc_for("p1", &["a"]), t0 + life - S, &pool);
        assert_eq!(before.response.already_sent_indexes, vec![0], "{life:?}");
        assert_idle(&pool);
        let after = push(&mut ks, &alloc_for("p1", &["a"]), t0 + life, &pool);
        assert!(
            matches!(after.verdict, Verdict::Accepted { new: 1, .. }),
            "{life:?}: {:?}",
            after.verdict
        );
        assert_eq!(ks.state("a"), Some(KeyState::PendingPush));
        assert_eq!(ks.counters().withdrawn_keys, 1);
        drop(after);
        ks.shut_down(|_| true);
        assert_idle(&pool);
    }
}

/// A PullReadyNotif of a request the decode cancelled before it came, in
/// pull-eager and pull-delay: the ack names every key already sent, so the
/// sender core releases its pins (and its grant) at the ack, without
/// waiting for a PullDoneSignal; nothing is read or stored here. The Done
/// that follows (in case the ack is lost) finds the pull released.
#[test]
fn a_pull_of_a_request_cancelled_before_it_came_releases_the_senders_pins_at_the_ack() {
    use crate::config::TransferMode;
    for mode in [TransferMode::PullEager, TransferMode::PullDelay] {
        let t0 = Instant::now();
        let (spool, rpool) = (pool(8), pool(8));
        let mut ks = receiver_with_ttl(Duration::from_secs(600));
        let mut sc = sender_core(mode, &spool);
        // `spec` saves request "req".
        ks.cancel(t0, "req", &keys(&["a", "b"]));
        let (mut put, _) = sc.begin_put(t0 + S, spec("r"), keys(&["a", "b"]), alloc(&spool, 2));
        sc.on_connected(&mut put, t0 + S, Some(attached(t0 + S)));
        let PutAction::Request { route, frame, .. } =
            sc.on_granted(&mut put, t0 + S, Some(GrantId(5)))
        else {
            panic!("{mode:?}: a PullReadyNotif")
        };
        let n = PullReadyNotif::decode(&frame).unwrap();
        assert_eq!(n.req_id.as_deref(), Some("req"));
        assert_eq!(spool.stats().pinned, 2);
        let reply = match ks.plan_pull(t0 + S, &route, &n, Some(LEASE)) {
            Err(reply) => *reply,
            Ok(plan) if mode == TransferMode::PullEager => {
                let pages = rpool.allocate_batch(plan.metas());
                ks.commit_pull_eager(plan, pages)
            }
            Ok(plan) => ks.commit_pull_delay(plan),
        };
        assert_eq!(reply.ack, ack(&[0, 1], false), "{mode:?}");
        assert!(
            matches!(reply.verdict, Verdict::Withdrawn { keys: 2, .. }),
            "{mode:?}: {:?}",
            reply.verdict
        );
        assert!(reply.read.is_none(), "{mode:?}: nothing to read");
        assert!(ks.is_empty(), "{mode:?}: no proxy stored");
        assert_eq!(ks.counters().contexts_open, 0);
        assert_idle(&rpool);

        let end = finish(sc.on_reply(&mut put, t0 + S, Ok(reply.ack.encode())));
        assert!(
            matches!(
                end.result,
                Ok(PutOutcome::Announced {
                    announced: 0,
                    already_present: 2,
                    ..
                })
            ),
            "{mode:?}: {end:?}"
        );
        drop(put);
        // Released at the ack: no Done was delivered.
        assert_eq!(sc.pulls_pending(), 0, "{mode:?}");
        assert_eq!(sc.take_grant_releases(), vec![GrantId(5)], "{mode:?}");
        assert!(sc.is_drained(), "{mode:?}");
        assert_idle(&spool);
        // The Done sent after the ack changes nothing.
        let [done] = &reply.done[..] else {
            panic!("{mode:?}: one Done after the ack: {:?}", reply.done)
        };
        assert!(
            matches!(
                sc.on_done_signal(t0 + 2 * S, &done.signal.pull_id),
                DoneOutcome::AlreadyReleased(_)
            ),
            "{mode:?}"
        );
        assert_idle(&spool);
    }
}

// ============================================================ peer restarts

/// A receiver that restarted refuses us (it does not know our attachment)
/// exactly as a full one does. The refusal makes the sender attach again;
/// a new incarnation answering means a restart: the pulls announced to the
/// old process are released (grants revoked, pages held until quiescent)
/// and the same put goes to the new process. No breaker opens.
#[test]
fn a_restarted_receiver_gets_the_put_and_its_old_pulls_are_released() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let spool = pool(8);
    let mut sc = sender_core(TransferMode::PullEager, &spool);
    let restarted = |t| Attached {
        incarnation: 2,
        ..attached(t)
    };
    // A pull announced to the first process, whose Done will never come.
    let (mut p1, _) = sc.begin_put(t0, spec("r"), keys(&["a"]), alloc(&spool, 1));
    sc.on_connected(&mut p1, t0, Some(attached(t0)));
    sc.on_granted(&mut p1, t0, Some(GrantId(3)));
    let end = finish(sc.on_reply(&mut p1, t0, Ok(ack(&[], false).encode())));
    assert!(matches!(end.result, Ok(PutOutcome::Announced { .. })));
    assert_eq!(sc.pulls_pending(), 1);

    // The receiver restarts; the next put is refused by the new process.
    let (mut p2, a) = sc.begin_put(t0, spec("r"), keys(&["b"]), alloc(&spool, 1));
    assert!(matches!(a, PutAction::Grant { .. }), "{a:?}");
    sc.on_granted(&mut p2, t0, Some(GrantId(4)));
    let a = sc.on_reply(&mut p2, t0, Ok(ack(&[], true).encode()));
    assert!(matches!(a, PutAction::ProbeIncarnation), "{a:?}");
    assert_eq!(sc.take_grant_releases(), vec![GrantId(4)]);
    // A new incarnation answers the probe: attach to the new process.
    let a = sc.on_probed(&mut p2, t0, Some(2));
    assert!(matches!(a, PutAction::Connect), "{a:?}");
    let a = sc.on_connected(&mut p2, t0, Some(restarted(t0)));
    // The old process's pull is released: its grant revoked, its page
    // kept until the channel says nobody reads it.
    assert_eq!(sc.pulls_pending(), 0);
    assert_eq!(sc.take_grant_revokes(), vec![GrantId(3)]);
    assert_eq!(sc.awaiting_quiescence(), vec![GrantId(3)]);
    assert_eq!(spool.stats().quarantined, 1);
    // ... and the put goes on to the new process.
    assert!(matches!(a, PutAction::Grant { .. }), "{a:?}");
    sc.on_granted(&mut p2, t0, Some(GrantId(5)));
    let end = finish(sc.on_reply(&mut p2, t0, Ok(ack(&[], false).encode())));
    assert!(
        matches!(end.result, Ok(PutOutcome::Announced { .. })),
        "{end:?}"
    );
    assert_eq!(sc.counters().receiver_restarts, 1);
    assert!(matches!(sc.breaker_state("r", t0), BreakerState::Closed));
    sc.on_quiescent(GrantId(3));
    drop((p1, p2));
}

/// Issue 25 item 7: a Done released a pull whose grant the channel still
/// served a read under (a tcp read the receiver gave up on); the pages went
/// back to the pool, and a new owner's bytes were sent out of them. A
/// grant the channel does not report free keeps its pages, quarantined,
/// until it is quiescent.
#[test]
fn a_released_grant_still_serving_a_read_keeps_its_pages_until_quiescent() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let spool = pool(4);
    let mut sc = sender_core(TransferMode::PullEager, &spool);
    let (mut put, _) = sc.begin_put(t0, spec("r"), keys(&["a"]), alloc(&spool, 1));
    sc.on_connected(&mut put, t0, Some(attached(t0)));
    sc.on_granted(&mut put, t0, Some(GrantId(9)));
    let end = finish(sc.on_reply(&mut put, t0, Ok(ack(&[], false).encode())));
    let Ok(PutOutcome::Announced { pull_id, .. }) = end.result else {
        panic!("{:?}", end.result)
    };
    drop(put);
    let outcome = sc.on_done_signal(t0 + S, &pull_id);
    assert!(matches!(outcome, DoneOutcome::Released(_)), "{outcome:?}");
    drop(outcome);
    // The channel still sends a read out of the page.
    let mut asked = Vec::new();
    let released = sc.release_grants(|g| {
        asked.push(g);
        false
    });
    assert_eq!((released, asked), (vec![GrantId(9)], vec![GrantId(9)]));
    let s = spool.stats();
    assert_eq!(
        (s.allocated, s.quarantined),
        (1, 1),
        "the page must not return to the pool under a read: {s:?}"
    );
    assert_eq!(sc.awaiting_quiescence(), vec![GrantId(9)]);
    assert!(!sc.is_drained());
    // Its read ended: the page returns.
    sc.on_quiescent(GrantId(9));
    assert!(sc.is_drained());
    assert_idle(&spool);
}

// ============================================================ shared prefixes

fn alloc_for(req: &str, k: &[&str]) -> AllocRequest {
    AllocRequest {
        req_id: Some(req.into()),
        ..alloc_request(k, 4)
    }
}

/// Two requests share key "k" (a deduplicated prefix): the second's
/// AllocRequest finds it present. It stays until both released it — by a
/// finished load or a cancel, in either order — and only then does its page
/// return. The same request announcing it again counts once.
#[test]
fn a_pushed_key_shared_by_two_requests_stays_until_both_are_done() {
    for (first, by_cancel) in [("r1", false), ("r2", false), ("r1", true), ("r2", true)] {
        let t0 = Instant::now();
        let pool = pool(8);
        let mut ks = receiver();
        let r1 = push(&mut ks, &alloc_for("r1", &["k", "a"]), t0, &pool);
        notice(
            &mut ks,
            ROUTE,
            ROUTE,
            PushOutcome::Landed,
            &refs_of(&r1.response),
            t0,
        );
        let r2 = push(&mut ks, &alloc_for("r2", &["k", "b"]), t0, &pool);
        assert_eq!(r2.response.already_sent_indexes, vec![0]);
        notice(
            &mut ks,
            ROUTE,
            ROUTE,
            PushOutcome::Landed,
            &refs_of(&r2.response),
            t0,
        );
        // r2 announced again (a retry): still two holders.
        push(&mut ks, &alloc_for("r2", &["k", "b"]), t0, &pool);
        assert_eq!(ks.holders("k"), 2);
        let (own1, own2, second) = if first == "r1" {
            ("a", "b", "r2")
        } else {
            ("b", "a", "r1")
        };
        if by_cancel {
            let c = ks.cancel(t0, first, &keys(&["k", own1]));
            assert_eq!(c.removed.len(), 1, "only its own key went: {c:?}");
        } else {
            assert!(ks.release(first, "k").unwrap().page.is_none());
            assert!(ks.release(first, own1).unwrap().page.is_some());
        }
        assert!(
            matches!(ks.get("k", t0), Lookup::Resident(_)),
            "{first} {by_cancel}"
        );
        assert_eq!(ks.holders("k"), 1);
        assert_eq!(
            stats(&pool),
            (2, 0),
            "{first} {by_cancel}: k and the other's key"
        );
        ks.release(second, "k").unwrap();
        ks.release(second, own2).unwrap();
        assert_eq!(ks.holders("k"), 0);
        assert!(ks.is_empty());
        assert_idle(&pool);
    }
}

/// A pull-delay proxy shared by two requests (LMCache-Ascend issue 250): the
/// first load that reads it does not consume it, so the sender's pages stay
/// pinned until the other request read it too (or was cancelled); the
/// pull's Done waits for that. In either order.
#[test]
fn a_shared_proxy_is_read_by_both_requests_and_its_done_waits_for_the_last() {
    for (first, second_cancels) in [("r1", false), ("r2", false), ("r1", true), ("r2", true)] {
        let t0 = Instant::now();
        let sender_pool = pool(4);
        let mut ks = receiver();
        let sp = alloc(&sender_pool, 2);
        let p1 = lease_id(t0 + LEASE);
        let n1 = PullReadyNotif {
            req_id: Some("r1".into()),
            ..notif(&p1, &["k", "a"], &sp)
        };
        delay(&mut ks, &n1, t0);
        let sp2 = alloc(&sender_pool, 2);
        let p2 = lease_id(t0 + LEASE + Duration::from_millis(1));
        let n2 = PullReadyNotif {
            req_id: Some("r2".into()),
            ..notif(&p2, &["k", "b"], &sp2)
        };
        let reply = delay(&mut ks, &n2, t0);
        assert_eq!(reply.ack.already_sent_indexes, vec![0]);
        assert_eq!(ks.holders("k"), 2);
        // A load of `key` for `req`, then its release (as the request API
        // does once the load is over).
        let read = |ks: &mut ReceiverCore, req: &str, key: &str| {
            let p = ks.begin_proxy_read(key, t0).unwrap();
            let done = ks.end_proxy_read_for(&p.handle, ReadOutcome::Consumed, Some(req));
            let released = ks.release(req, key).and_then(|r| r.done);
            done.or(released).map(|d| d.signal.pull_id)
        };
        let (own1, own2, second) = if first == "r1" {
            ("a", "b", "r2")
        } else {
            ("b", "a", "r1")
        };
        let mut dones: Vec<String> = Vec::new();
        dones.extend(read(&mut ks, first, "k"));
        dones.extend(read(&mut ks, first, own1));
        assert_eq!(ks.state("k"), Some(KeyState::Proxy), "{first}: k stays");
        assert!(!dones.contains(&p1), "{first}: p1 carries k, still needed");
        if second_cancels {
            let c = ks.cancel(t0, second, &keys(&["k", own2]));
            dones.extend(
                c.removed
                    .iter()
                    .filter_map(|(_, r)| r.done.as_ref())
                    .map(|d| d.signal.pull_id.clone()),
            );
        } else {
            dones.extend(read(&mut ks, second, "k"));
            dones.extend(read(&mut ks, second, own2));
        }
        assert_eq!(ks.state("k"), None, "{first} {second_cancels}");
        assert_eq!(ks.counters().proxies, 0);
        dones.sort();
        let mut want = vec![p1.clone(), p2.clone()];
        want.sort();
        assert_eq!(dones, want, "{first} {second_cancels}: each Done once");
        drop((sp, sp2));
    }
}

/// A restarted sender's proxies point at memory that is gone: forgetting
/// the sender discards them (a load says why), and leaves every other
/// sender's proxies alone.
#[test]
fn forgetting_a_restarted_sender_discards_only_its_proxies() {
    let t0 = Instant::now();
    let sender_pool = pool(4);
    let mut ks = receiver();
    let sp = alloc(&sender_pool, 2);
    delay(&mut ks, &notif(&lease_id(t0 + LEASE), &["a", "b"], &sp), t0);
    let other = PullReadyNotif {
        sender_id: "prefill:7601".into(),
        ..notif(&lease_id(t0 + LEASE), &["c"], &sp[..1])
    };
    // A different sender's notification must come on its own route.
    let reply = match ks.plan_pull(t0, "prefill:7601#0", &other, Some(LEASE)) {
        Ok(plan) => ks.commit_pull_delay(plan),
        Err(r) => *r,
    };
    assert!(!reply.ack.alloc_failed, "{reply:?}");
    assert_eq!(ks.forget_sender(SENDER, t0), 2);
    assert!(matches!(ks.get("a", t0), Lookup::SenderRestarted));
    assert!(matches!(ks.get("c", t0), Lookup::Proxy(_)));
    assert_eq!(ks.counters().proxies, 1);
    drop(sp);
}

/// The decode side may name requests differently from the prefill side:
/// releases under other names still count one hold each, so the key goes
/// after its last request. A key one request cancelled while it was still
/// landing, and another request then claimed, is kept when it lands.
#[test]
fn holds_count_under_other_names_and_a_new_claim_undoes_a_pending_cancel() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut ks = receiver();
    let r1 = push(&mut ks, &alloc_for("p1", &["k"]), t0, &pool);
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&r1.response),
        t0,
    );
    push(&mut ks, &alloc_for("p2", &["k"]), t0, &pool);
    assert_eq!(ks.holders("k"), 2);
    assert!(ks.release("decode-1", "k").unwrap().page.is_none());
    assert_eq!(ks.holders("k"), 1);
    assert!(ks.release("decode-2", "k").unwrap().page.is_some());
    assert_idle(&pool);

    // "late" is still being pushed when its only request cancels it...
    let r = push(&mut ks, &alloc_for("a", &["late"]), t0, &pool);
    let c = ks.cancel(t0, "a", &keys(&["late"]));
    assert_eq!(c.deferred, keys(&["late"]));
    // ... then another request announces it (told: already sent).
    let b = push(&mut ks, &alloc_for("b", &["late"]), t0, &pool);
    assert_eq!(b.response.already_sent_indexes, vec![0]);
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&r.response),
        t0,
    );
    assert!(
        matches!(ks.get("late", t0), Lookup::Resident(_)),
        "b still needs it"
    );
    ks.release("b", "late");
    assert_idle(&pool);
}

/// One request's failed read of a shared proxy leaves it to the other,
/// which reads it; the pull's Done goes out after that read.
#[test]
fn a_failed_read_of_a_shared_proxy_leaves_it_to_the_other_request() {
    let t0 = Instant::now();
    let sender_pool = pool(4);
    let mut ks = receiver();
    let sp = alloc(&sender_pool, 1);
    let p1 = lease_id(t0 + LEASE);
    delay(
        &mut ks,
        &PullReadyNotif {
            req_id: Some("r1".into()),
            ..notif(&p1, &["k"], &sp)
        },
        t0,
    );
    let p2 = lease_id(t0 + LEASE + Duration::from_millis(1));
    delay(
        &mut ks,
        &PullReadyNotif {
            req_id: Some("r2".into()),
            ..notif(&p2, &["k"], &sp)
        },
        t0,
    );
    let p = ks.begin_proxy_read("k", t0).unwrap();
    assert!(ks
        .end_proxy_read_for(&p.handle, ReadOutcome::Failed, Some("r1"))
        .is_none());
    ks.release("r1", "k");
    assert_eq!(ks.state("k"), Some(KeyState::Proxy), "kept for r2");
    let p = ks.begin_proxy_read("k", t0).unwrap();
    let done = ks.end_proxy_read_for(&p.handle, ReadOutcome::Consumed, Some("r2"));
    assert_eq!(done.map(|d| d.signal.pull_id), Some(p1));
    assert_eq!(ks.state("k"), None);
    drop(sp);
}

/// The shell allocates a plan's pages outside the core's lock, so the last
/// holder of a key a plan found present can let go before that plan is
/// committed. The key must stay for the newcomer, whose reply says it is
/// already here: kept when the plan commits, dropped after all (page back,
/// Done out) when it is given up. For a resident key and a proxy alike.
#[test]
fn a_key_found_present_stays_until_the_plan_that_found_it_ends() {
    for commit in [true, false] {
        let t0 = Instant::now();
        let pool = pool(8);
        let mut ks = receiver();
        // r1 holds resident "k"; r2's AllocRequest finds it present.
        let r1 = push(&mut ks, &alloc_for("r1", &["k"]), t0, &pool);
        notice(
            &mut ks,
            ROUTE,
            ROUTE,
            PushOutcome::Landed,
            &refs_of(&r1.response),
            t0,
        );
        let plan = ks
            .plan_push(t0, ROUTE_NEXT, &alloc_for("r2", &["k", "b"]))
            .expect("b is new: pages to allocate");
        // Meanwhile r1's load ends and lets go of "k".
        assert!(ks.release("r1", "k").unwrap().page.is_none(), "kept");
        assert!(matches!(ks.get("k", t0), Lookup::Resident(_)));
        if commit {
            let pages = plan.check_pages(pool.allocate_batch(plan.metas()));
            let r2 = ks.commit_push(t0, plan, pages.map(|p| (p, Some(GRANT))));
            assert_eq!(r2.response.already_sent_indexes, vec![0]);
            assert_eq!(ks.holders("k"), 1, "r2 holds it now");
            notice(
                &mut ks,
                ROUTE_NEXT,
                ROUTE_NEXT,
                PushOutcome::Landed,
                &refs_of(&r2.response),
                t0,
            );
            assert!(ks.release("r2", "k").unwrap().page.is_some());
            assert!(ks.release("r2", "b").unwrap().page.is_some());
        } else {
            // r2's pages are not free yet: its plan is given up, and "k",
            // which nobody holds or claims any more, goes.
            assert!(ks.shelve_push(plan).is_empty());
            assert_eq!(ks.state("k"), None);
        }
        assert!(ks.is_empty(), "commit {commit}");
        assert_idle(&pool);
    }

    for commit in [true, false] {
        let t0 = Instant::now();
        let sender_pool = pool(4);
        let pool = pool(4);
        let mut ks = receiver();
        let sp = alloc(&sender_pool, 2);
        let p1 = lease_id(t0 + LEASE);
        delay(
            &mut ks,
            &PullReadyNotif {
                req_id: Some("r1".into()),
                ..notif(&p1, &["k"], &sp[..1])
            },
            t0,
        );
        // r2's eager pull finds "k" present and waits for a page for "b".
        let p2 = lease_id(t0 + LEASE + Duration::from_millis(1));
        let n2 = PullReadyNotif {
            req_id: Some("r2".into()),
            ..notif(&p2, &["k", "b"], &sp)
        };
        let plan = ks.plan_pull(t0, SENDER_ROUTE, &n2, Some(LEASE)).unwrap();
        // r1 reads "k" and lets go: the proxy is kept, p1's Done waits.
        let p = ks.begin_proxy_read("k", t0).unwrap();
        assert!(ks
            .end_proxy_read_for(&p.handle, ReadOutcome::Consumed, Some("r1"))
            .is_none());
        assert!(ks.release("r1", "k").unwrap().done.is_none());
        assert_eq!(ks.state("k"), Some(KeyState::Proxy));
        if commit {
            let pages = pool.allocate_batch(plan.metas());
            let reply = ks.commit_pull_eager(plan, pages);
            assert_eq!(reply.ack.already_sent_indexes, vec![0]);
            assert_eq!(ks.holders("k"), 1, "r2 holds it now");
            let p = ks.begin_proxy_read("k", t0).unwrap();
            let done = ks.end_proxy_read_for(&p.handle, ReadOutcome::Consumed, Some("r2"));
            assert_eq!(done.map(|d| d.signal.pull_id), Some(p1.clone()));
            let read = reply.read.expect("b is read");
            assert!(ks
                .on_read_complete(&read.pull_id, Some(read.pages))
                .is_some());
            ks.release("r2", "k");
            ks.release("r2", "b");
        } else {
            let done = ks.shelve_pull(plan);
            let ids: Vec<String> = done.into_iter().map(|d| d.signal.pull_id).collect();
            assert_eq!(ids, vec![p1.clone()], "the proxy goes with its Done");
            assert_eq!(ks.state("k"), None);
        }
        assert!(ks.is_empty(), "commit {commit}");
        assert_eq!(ks.counters().proxies, 0);
        assert_idle(&pool);
        drop(sp);
    }
}

/// A landed chunk nobody loads or cancels goes at `pd_resident_ttl`,
/// counted from the first sweep that saw it resident: its page is back in
/// the pool, and a lookup says why it is gone. One loaded in time, or with
/// no TTL, stays; a chunk still landing is not counted.
#[test]
fn a_landed_chunk_nobody_loads_goes_back_to_the_pool_at_the_resident_ttl() {
    let ttl = Duration::from_secs(600);
    let t0 = Instant::now();
    let pool = pool(8);
    let mut ks = ReceiverCore::new(ReceiverConfig {
        resident_ttl: Some(ttl),
        ..*receiver().config()
    });
    let r = push(&mut ks, &alloc_for("r1", &["old", "fresh"]), t0, &pool);
    // Not landed yet: the sweep does not start its clock.
    assert!(ks.sweep(t0).expired_resident.is_empty());
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&r.response),
        t0 + S,
    );
    let t1 = t0 + 2 * S;
    assert!(ks.sweep(t1).expired_resident.is_empty(), "first seen at t1");
    // A load takes "fresh" (and releases it) before the TTL.
    let held = match ks.get("fresh", t1) {
        Lookup::Resident(m) => m.clone(),
        other => panic!("{other:?}"),
    };
    assert!(ks.release("r1", "fresh").unwrap().page.is_some());
    assert!(ks.sweep(t1 + ttl - S).expired_resident.is_empty());
    let report = ks.sweep(t1 + ttl);
    assert_eq!(report.expired_resident, keys(&["old"]));
    assert!(matches!(ks.get("old", t1 + ttl), Lookup::ResidentExpired));
    assert_eq!(ks.counters().expired_resident, 1);
    assert!(ks.is_empty());
    drop(held);
    assert_idle(&pool);

    // A key another request takes on gets the whole TTL again; one a plan
    // claimed is kept while the plan's pages are found.
    let r = push(&mut ks, &alloc_for("r1", &["shared"]), t1, &pool);
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&r.response),
        t1,
    );
    ks.sweep(t1);
    let r2 = push(&mut ks, &alloc_for("r2", &["shared"]), t1 + ttl - S, &pool);
    assert_eq!(r2.response.already_sent_indexes, vec![0]);
    assert!(
        ks.sweep(t1 + ttl).expired_resident.is_empty(),
        "r2 took it on"
    );
    let plan = ks
        .plan_push(t1 + ttl, ROUTE_NEXT, &alloc_for("r3", &["shared", "new"]))
        .unwrap();
    assert!(
        ks.sweep(t1 + 3 * ttl).expired_resident.is_empty(),
        "claimed"
    );
    let pages = plan.check_pages(pool.allocate_batch(plan.metas()));
    let r3 = ks.commit_push(t1 + 3 * ttl, plan, pages.map(|p| (p, Some(GRANT))));
    assert_eq!(r3.response.already_sent_indexes, vec![0]);
    notice(
        &mut ks,
        ROUTE_NEXT,
        ROUTE_NEXT,
        PushOutcome::Landed,
        &refs_of(&r3.response),
        t1 + 3 * ttl,
    );
    ks.sweep(t1 + 3 * ttl);
    assert!(ks.sweep(t1 + 4 * ttl - S).expired_resident.is_empty());
    let mut gone = ks.sweep(t1 + 4 * ttl).expired_resident;
    gone.sort();
    assert_eq!(gone, keys(&["new", "shared"]));
    assert!(ks.is_empty());
    assert_idle(&pool);

    // Without a TTL nothing expires.
    let mut ks = receiver();
    let r = push(&mut ks, &alloc_for("r2", &["k"]), t0, &pool);
    notice(
        &mut ks,
        ROUTE,
        ROUTE,
        PushOutcome::Landed,
        &refs_of(&r.response),
        t0,
    );
    ks.sweep(t0);
    assert!(ks.sweep(t0 + 1000 * ttl).expired_resident.is_empty());
    assert!(ks.release("r2", "k").unwrap().page.is_some());
    assert_idle(&pool);
}

/// A receiver whose process is gone never sends its Dones: the pulls
/// announced to it are released when the channel reports it gone (grant
/// revoked, pages kept until quiescent), not at the TTL; its attachment
/// ends, so the next put attaches afresh. Another peer's report leaves it.
#[test]
fn a_gone_receivers_pulls_are_released_and_the_next_put_attaches_again() {
    use crate::channel::PeerId;
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let spool = pool(8);
    let mut sc = sender_core(TransferMode::PullDelay, &spool);
    let (mut p1, _) = sc.begin_put(t0, spec("r"), keys(&["a", "b"]), alloc(&spool, 2));
    sc.on_connected(&mut p1, t0, Some(attached(t0)));
    sc.on_granted(&mut p1, t0, Some(GrantId(3)));
    let end = finish(sc.on_reply(&mut p1, t0, Ok(ack(&[], false).encode())));
    assert!(matches!(end.result, Ok(PutOutcome::Announced { .. })));
    assert_eq!(sc.pulls_pending(), 1);

    assert!(sc.receivers_gone(&[PeerId(99)], t0).is_empty(), "not ours");
    assert_eq!(sc.pulls_pending(), 1);
    let gone = sc.receivers_gone(&[attached(t0).peer], t0);
    assert_eq!(gone.len(), 1);
    assert_eq!(gone[0].1, 1, "one pull released");
    assert_eq!(sc.pulls_pending(), 0);
    assert_eq!(sc.take_grant_revokes(), vec![GrantId(3)]);
    assert_eq!(spool.stats().quarantined, 2);
    sc.on_quiescent(GrantId(3));
    assert_eq!(spool.stats().quarantined, 0);
    assert!(sc.attached(&gone[0].0).is_none());
    let (_p2, a) = sc.begin_put(t0, spec("r"), keys(&["c"]), alloc(&spool, 1));
    assert!(matches!(a, PutAction::Connect), "{a:?}");
    drop(p1);
}

/// CI soak finding: a receiver process killed before its Done left; the
/// sweep released its pull (`receivers_gone`) and `Sender::drain`, which
/// waited for no pull pending, returned while the pages still waited for
/// their revoked grant to be quiescent: the soak found them out of the
/// pool. The same holds for a pull that expires at its TTL. A sender is
/// drained only once those pages are back.
#[test]
fn a_sender_is_drained_only_once_the_pages_of_released_pulls_are_back() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let spool = pool(8);
    let mut sc = sender_core(TransferMode::PullDelay, &spool);
    assert!(sc.is_drained());
    let announce = |sc: &mut SenderCore, grant: u64, n: usize| {
        let (mut p, _) = sc.begin_put(t0, spec("r"), keys(&["a", "b", "c"][..n]), alloc(&spool, n));
        if sc.attached("r").is_none() {
            sc.on_connected(&mut p, t0, Some(attached(t0)));
        }
        sc.on_granted(&mut p, t0, Some(GrantId(grant)));
        let end = finish(sc.on_reply(&mut p, t0, Ok(ack(&[], false).encode())));
        assert!(matches!(end.result, Ok(PutOutcome::Announced { .. })));
    };

    // The receiver's process is gone: its pull ends at once, its pages
    // only when its grant, revoked, is quiescent.
    announce(&mut sc, 3, 3);
    assert_eq!(stats(&spool), (3, 3));
    assert!(!sc.is_drained());
    assert_eq!(sc.receivers_gone(&[attached(t0).peer], t0)[0].1, 1);
    assert_eq!(sc.pulls_pending(), 0);
    assert!(!sc.is_drained(), "the pages are still out of the pool");
    assert_eq!(sc.take_grant_revokes(), vec![GrantId(3)]);
    assert_eq!((stats(&spool), spool.stats().quarantined), ((3, 0), 3));
    sc.on_quiescent(GrantId(3));
    assert!(sc.is_drained());
    assert_idle(&spool);

    // A pull with no Done by its TTL: the same until the channel says
    // nobody reads its pages any more.
    announce(&mut sc, 4, 2);
    assert!(sc.sweep(t0 + TTL - S).is_empty());
    assert_eq!(sc.sweep(t0 + TTL).len(), 1);
    assert_eq!(sc.pulls_pending(), 0);
    assert!(!sc.is_drained(), "a read may still be served from them");
    assert_eq!(sc.take_grant_revokes(), vec![GrantId(4)]);
    assert_eq!(stats(&spool), (2, 0));
    sc.on_quiescent(GrantId(4));
    assert!(sc.is_drained());
    assert_idle(&spool);
}

// ======================================== one copy of each ownership rule

/// The load shell as far as giving up a proxy goes: the real core, the
/// Dones it sends, nothing else.
struct GiveUpEnv {
    core: std::sync::Mutex<ReceiverCore>,
    dones: std::sync::Mutex<Vec<SendPullDone>>,
}

impl crate::pipeline::load::LoadEnv for GiveUpEnv {
    fn core(&self) -> std::sync::MutexGuard<'_, ReceiverCore> {
        self.core.lock().unwrap()
    }
    fn channel(&self) -> &dyn crate::channel::TransferChannel {
        unreachable!("giving up a proxy moves no bytes")
    }
    fn pool(&self) -> &Arc<PagePool> {
        unreachable!("giving up a proxy takes no page")
    }
    fn layout(&self) -> ChunkLayout {
        layout()
    }
    fn page_wait(&self) -> Duration {
        Duration::ZERO
    }
    fn peer_of(&self, _: &str) -> Option<crate::channel::PeerId> {
        None
    }
    fn send_done(&self, done: SendPullDone) {
        self.dones.lock().unwrap().push(done);
    }
    fn read_bytes(&self, _: u64) {}
    fn transfer_failed(&self) {}
}

/// Request "a" holds proxy "k"; request "b"'s announcement of "k" is
/// planned (so "b"'s sender is told "k" is already here) but not yet
/// committed.
fn proxy_claimed_by_a_newcomer(t: Instant) -> (ReceiverCore, receiver::PullPlan) {
    let mut ks = receiver();
    let deadline = t + LEASE;
    let a = PullReadyNotif {
        req_id: Some("a".into()),
        ..remote_notif(&lease_id(deadline), &["k"])
    };
    let r = delay(&mut ks, &a, t);
    assert!(r.ack.already_sent_indexes.is_empty(), "{r:?}");
    let b = PullReadyNotif {
        req_id: Some("b".into()),
        ..remote_notif(&lease_id(deadline + S), &["k"])
    };
    let plan = ks
        .plan_pull(t, SENDER_ROUTE, &b, Some(LEASE))
        .expect("b's announcement is planned");
    (ks, plan)
}

/// The load shell used to apply its own copy of the shared-prefix rule
/// when a load gave a proxy up: it counted holders but not claims, so a
/// newcomer whose sender had just been told "already here" found the key
/// dropped. The core decides now, and the key stays for the newcomer.
#[test]
fn a_load_giving_up_a_proxy_keeps_it_for_a_plan_that_claimed_it() {
    let t = Instant::now();
    let (ks, plan) = proxy_claimed_by_a_newcomer(t);
    let env = GiveUpEnv {
        core: std::sync::Mutex::new(ks),
        dones: Default::default(),
    };
    // "a"'s load of "k" failed (its read did): the proxy is given up.
    assert!(!crate::pipeline::load::discard_proxy(&env, "k", Some("a")));
    let mut ks = env.core.into_inner().unwrap();
    assert_eq!(ks.state("k"), Some(KeyState::Proxy), "kept for b");
    let reply = ks.commit_pull_delay(plan);
    assert_eq!(reply.ack.already_sent_indexes, vec![0]);
    assert!(matches!(ks.get("k", t), Lookup::Proxy(_)), "b can load it");
    assert!(env.dones.into_inner().unwrap().is_empty());
}

/// An eviction (`Receiver::remove`) used to drop a key an uncommitted plan
/// had claimed, after its sender was told it need not send it.
#[test]
fn removing_a_key_a_plan_claimed_keeps_it_for_the_claimant() {
    let t = Instant::now();
    let (mut ks, plan) = proxy_claimed_by_a_newcomer(t);
    assert!(ks.remove("k").is_none(), "claimed: it stays");
    let reply = ks.commit_pull_delay(plan);
    assert_eq!(reply.ack.already_sent_indexes, vec![0]);
    assert!(matches!(ks.get("k", t), Lookup::Proxy(_)));
    // Once nobody claims it, an eviction removes it.
    assert!(ks.remove("k").is_some());
    assert_eq!(ks.state("k"), None);
}

/// The layout of the layer-wise tests: three layers.
fn lw_layout() -> ChunkLayout {
    ChunkLayout {
        layers: 3,
        ..layout()
    }
}

/// Sender and receiver cores of [`lw_layout`], with a pool each.
fn lw_cores(
    mode: crate::config::TransferMode,
) -> (Arc<PagePool>, Arc<PagePool>, SenderCore, ReceiverCore) {
    let page = lw_layout().page_bytes();
    let pool = || PagePool::new(RegisteredBuffer::host(8 * page, page, false).unwrap());
    let (spool, rpool) = (pool(), pool());
    let sc = SenderCore::new(SenderConfig {
        node: "prefill:7600/p1r0-00000001".into(),
        done_url: "prefill:7600".into(),
        mode,
        layout: lw_layout(),
        pools: [spool.uuid()].into_iter().collect(),
        pull_pending_ttl: TTL,
        alloc_fail_backoff_ttl: Duration::from_secs(2),
        backpressure: Backpressure::new(spool.stats().total, 25.0),
        reserve_pct: 25.0,
    });
    let ks = ReceiverCore::new(ReceiverConfig {
        layout: lw_layout(),
        push_landing_timeout: Duration::from_secs(5),
        read_margin_pct: 10.0,
        resident_ttl: None,
    });
    (spool, rpool, sc, ks)
}

fn lw_alloc(pool: &Arc<PagePool>, n: usize) -> Vec<SealedMemObj> {
    pool.allocate_batch(&vec![ChunkMeta::full(lw_layout()); n])
        .unwrap()
        .into_iter()
        .map(MemObj::seal)
        .collect()
}

/// A layer-wise push asks for one layer at a time after the allocation,
/// in order, and sends `landed` only after the last: until then the
/// receiver holds the keys as landing, never loadable.
#[test]
fn a_layerwise_push_writes_layer_by_layer_and_lands_only_after_the_last() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let (spool, rpool, mut sc, mut ks) = lw_cores(TransferMode::Push);
    let pages = lw_alloc(&spool, 2);
    let descs: Vec<ChunkDesc> = pages.iter().map(|p| ChunkDesc::of(p)).collect();
    let (mut put, a) = sc.begin_layered_put(t0, spec("r:7400"), keys(&["a", "b"]), &descs);
    assert!(matches!(a, PutAction::Connect), "{a:?}");
    let a = sc.on_connected(&mut put, t0, Some(attached(t0)));
    let PutAction::Request { route, frame, .. } = a else {
        panic!("{a:?}")
    };
    let req = AllocRequest::decode(&frame).unwrap();
    let reply = push_with(
        &mut ks,
        &req,
        &route,
        t0,
        |m| rpool.allocate_batch(m),
        Some(GRANT),
    );
    let remotes: Vec<u64> = reply.response.remote_indexes.clone();
    let mut a = sc.on_reply(
        &mut put,
        t0,
        Ok(Message::AscendAllocResponse(reply.response).encode()),
    );
    let layers = lw_layout().layers;
    assert_ne!(
        sc.route("r:7400"),
        route,
        "puts that start during the forward pass get a route of their own"
    );
    for want in 0..layers {
        let PutAction::WriteLayer {
            layer,
            targets,
            tag,
            ..
        } = a
        else {
            panic!("layer {want}: {a:?}")
        };
        assert_eq!(layer, want);
        assert_eq!(Some(tag), GrantTag::of_route(&route));
        assert_eq!(
            targets
                .iter()
                .map(|t| (t.0, u64::from(t.1.page)))
                .collect::<Vec<_>>(),
            vec![(0, remotes[0]), (1, remotes[1])]
        );
        assert_eq!(ks.state("a"), Some(KeyState::PendingPush), "layer {want}");
        a = sc.on_written(&mut put, t0, WriteEnd::Written);
    }
    let PutAction::Request {
        route: r2,
        frame,
        kind,
    } = a
    else {
        panic!("{a:?}")
    };
    assert_eq!(kind, RequestKind::PushNotice);
    let n = PushNotice::decode(&frame).unwrap().unwrap();
    assert_eq!(n.outcome, PushOutcome::Landed);
    let answer = ks.on_push_notice(t0, &r2, &n, |_| true);
    let end = finish(sc.on_reply(&mut put, t0, Ok(notice::encode_reply(&answer.result))));
    assert_eq!(
        end.result,
        Ok(PutOutcome::Pushed {
            written: 2,
            already_present: 0
        })
    );
    assert_eq!(ks.state("a"), Some(KeyState::Resident));
}

/// A layer that never comes, or a layer's write that failed, ends the put
/// with an `aborted` notice naming the pages: the receiver frees them at
/// once and the keys never become loadable.
#[test]
fn a_layerwise_push_missing_a_layer_or_failing_one_aborts_the_allocation() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let layers = lw_layout().layers;
    // None: the layer never comes; Some(true): its write fails; Some(false):
    // another put broke the link to the receiver during the save.
    for failing in [None, Some(true), Some(false)] {
        let (spool, rpool, mut sc, mut ks) = lw_cores(TransferMode::Push);
        let pages = lw_alloc(&spool, 1);
        let descs: Vec<ChunkDesc> = pages.iter().map(|p| ChunkDesc::of(p)).collect();
        let (mut put, _) = sc.begin_layered_put(t0, spec("r:7400"), keys(&["a"]), &descs);
        let a = sc.on_connected(&mut put, t0, Some(attached(t0)));
        let PutAction::Request { route, frame, .. } = a else {
            panic!("{a:?}")
        };
        let req = AllocRequest::decode(&frame).unwrap();
        let reply = push_with(
            &mut ks,
            &req,
            &route,
            t0,
            |m| rpool.allocate_batch(m),
            Some(GRANT),
        );
        let mut a = sc.on_reply(
            &mut put,
            t0,
            Ok(Message::AscendAllocResponse(reply.response).encode()),
        );
        // The link breaks while layer 0 is written; the other cases reach
        // the last layer.
        let stop = if failing == Some(false) {
            0
        } else {
            layers - 1
        };
        for _ in 0..stop {
            assert!(matches!(a, PutAction::WriteLayer { .. }), "{a:?}");
            a = sc.on_written(&mut put, t0, WriteEnd::Written);
        }
        let PutAction::WriteLayer { layer, .. } = a else {
            panic!("{a:?}")
        };
        assert_eq!(layer, stop);
        let a = match failing {
            None => sc.on_layer_missing(&mut put, t0, "closed early".into()),
            Some(true) => sc.on_written(&mut put, t0, WriteEnd::Failed),
            Some(false) => {
                sc.receivers_gone(&[crate::channel::PeerId(7)], t0);
                sc.on_written(&mut put, t0, WriteEnd::Written)
            }
        };
        let PutAction::Request {
            route: r2, frame, ..
        } = a
        else {
            panic!("{a:?}")
        };
        let n = PushNotice::decode(&frame).unwrap().unwrap();
        assert_eq!(n.outcome, PushOutcome::Aborted);
        assert_eq!(n.refs.len(), 1, "the notice names the allocation's page");
        let answer = ks.on_push_notice(t0, &r2, &n, |_| true);
        assert_eq!(answer.result, Ok(()));
        let end = finish(sc.on_reply(&mut put, t0, Ok(notice::encode_reply(&answer.result))));
        match failing {
            None => assert_eq!(
                end.result,
                Err(PutFailure::Rejected(PutRejected::LayerMissing {
                    layer: layers - 1,
                    layers,
                    why: "closed early".into()
                }))
            ),
            Some(true) => assert_eq!(end.result, Err(PutFailure::Io)),
            Some(false) => assert!(
                matches!(&end.result, Err(PutFailure::Rejected(PutRejected::LayerMissing { layer: 1, why, .. })) if why.contains("link")),
                "{:?}",
                end.result
            ),
        }
        assert_eq!(ks.state("a"), None, "the key is dropped, never loadable");
        drop(pages);
        drop(put);
        assert_idle(&spool);
    }
}

/// Layer-wise puts are a push feature: a pull sender refuses them before
/// anything is sent.
#[test]
fn a_layerwise_put_in_a_pull_mode_is_refused_before_anything_is_sent() {
    use crate::config::TransferMode;
    let t0 = Instant::now();
    let (spool, _, mut sc, _) = lw_cores(TransferMode::PullDelay);
    let pages = lw_alloc(&spool, 1);
    let descs: Vec<ChunkDesc> = pages.iter().map(|p| ChunkDesc::of(p)).collect();
    let (_, a) = sc.begin_layered_put(t0, spec("r:7400"), keys(&["a"]), &descs);
    let end = finish(a);
    assert!(
        matches!(&end.result, Err(PutFailure::Rejected(PutRejected::InvalidInput(m))) if m.contains("push")),
        "{:?}",
        end.result
    );
}
