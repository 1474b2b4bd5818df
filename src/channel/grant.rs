//! Grants: which local pages an attached peer may read or write, and, once
//! a grant is revoked, whether the peer can still touch them.
//!
//! A page owner grants pages to one peer (a receiver's pages to the sender
//! that pushes into them, a sender's pinned pages to the receiver that
//! pulls them). The grant ends either with the peer's own report (its
//! write landed, its reads are done or its lease is over: [`release`]) or
//! without one ([`revoke`]: a push that never reported). After a revoke the
//! pages stay with their owner, quarantined, until the channel says the
//! peer can no longer touch them ([`TransferChannel::is_quiescent`]):
//!
//! - `tcp` refuses every request for a page outside a live grant of the
//!   requesting peer (counted, logged once per peer), so a revoked grant is
//!   quiescent as soon as the requests already being served have finished;
//! - `shm` and `hccl` cannot refuse a peer's one-sided access: the peer
//!   maps or registered our memory. A revoked write grant is quiescent only
//!   when the peer process is gone (shm), or the peer closed its side of
//!   the pair after its last batch ended (hccl). A revoked *read* grant is
//!   quiescent at once: a late read cannot change our pages, and the pull
//!   lease keeps the reader from using what it read too late.
//!
//! [`release`]: super::TransferChannel::release
//! [`revoke`]: super::TransferChannel::revoke
//! [`TransferChannel::is_quiescent`]: super::TransferChannel::is_quiescent

use crate::memory::BufferRef;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// What a peer may do with granted pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Read them (a pull's pinned pages).
    Read,
    /// Write them (pages allocated for a push).
    Write,
    /// Both (tests and the channel bench).
    ReadWrite,
}

impl Access {
    fn allows(self, write: bool) -> bool {
        match self {
            Access::ReadWrite => true,
            Access::Write => write,
            Access::Read => !write,
        }
    }
}

/// A grant of local pages to one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GrantId(pub u64);

impl fmt::Display for GrantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "grant#{}", self.0)
    }
}

/// Which of a peer's grants a request acts under.
///
/// A peer can be granted the same page again after an earlier grant of it
/// ended, and a request of the earlier one may still be on its way (a
/// connection the peer gave up on still delivers what it had queued). Node
/// and page alone cannot tell the two apart; the tag can: a push grant is
/// tagged with the allocation's route (`<node>#<n>`, a number the writer
/// never reuses after a write that did not land), its writes carry the
/// same tag, and a request is served only under a grant with the tag it
/// carries. Pull grants and reads are untagged: a late read cannot change
/// our pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GrantTag(Option<u64>);

impl GrantTag {
    /// No tag: matches only untagged grants.
    pub const UNTAGGED: GrantTag = GrantTag(None);

    /// Tag number `n`.
    pub fn new(n: u64) -> GrantTag {
        GrantTag(Some(n))
    }

    /// The tag of the allocation asked for on `route` (`<node>#<n>`: `n`);
    /// `None` when the route has no number.
    pub fn of_route(route: &str) -> Option<GrantTag> {
        let (_, n) = route.rsplit_once('#')?;
        n.parse().ok().map(GrantTag::new)
    }

    /// The number, if tagged.
    pub fn get(self) -> Option<u64> {
        self.0
    }
}

impl fmt::Display for GrantTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(n) => write!(f, "tag {n}"),
            None => f.write_str("no tag"),
        }
    }
}

/// Counters of a channel's grants.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrantStats {
    /// Grants in force.
    pub live: usize,
    /// Grants revoked whose peer may still touch the pages.
    pub revoked: usize,
    /// Peer requests refused because no live grant of that peer covered
    /// the page (tcp only: the other channels cannot see requests).
    pub refused: u64,
    /// Connections refused because the peer did not prove it holds the
    /// deployment secret: tcp transfer connections, and hccl liveness
    /// links opened for a waiting session without a valid proof.
    pub unauthenticated: u64,
    /// Transfer connections refused because the server already served
    /// its maximum (tcp only; `TcpOptions::max_server_connections`).
    pub busy: u64,
}

pub(crate) struct Entry<S> {
    pub(crate) node: String,
    access: Access,
    tag: GrantTag,
    pages: Vec<BufferRef>,
    pub(crate) revoked: bool,
    pub(crate) inflight: u32,
    pub(crate) session: S,
}

struct Grants<S> {
    by_id: HashMap<GrantId, Entry<S>>,
    by_page: HashMap<BufferRef, Vec<GrantId>>,
}

impl<S> Grants<S> {
    fn remove(&mut self, id: GrantId) {
        if let Some(e) = self.by_id.remove(&id) {
            for p in &e.pages {
                if let Some(v) = self.by_page.get_mut(p) {
                    v.retain(|g| *g != id);
                    if v.is_empty() {
                        self.by_page.remove(p);
                    }
                }
            }
        }
    }
}

/// The grant table of one channel; `S` is what the channel needs to judge
/// a revoked grant's quiescence (the peer's process or session).
pub(crate) struct GrantTable<S> {
    grants: Mutex<Grants<S>>,
    next: AtomicU64,
    refused: AtomicU64,
    refused_logged: Mutex<HashSet<String>>,
}

impl<S> Default for GrantTable<S> {
    fn default() -> Self {
        GrantTable {
            grants: Mutex::new(Grants {
                by_id: HashMap::new(),
                by_page: HashMap::new(),
            }),
            next: AtomicU64::new(1),
            refused: AtomicU64::new(0),
            refused_logged: Mutex::new(HashSet::new()),
        }
    }
}

/// A request being served under a grant; the grant counts it until dropped.
pub(crate) struct Serving<'a, S> {
    table: &'a GrantTable<S>,
    id: GrantId,
}

impl<S> Drop for Serving<'_, S> {
    fn drop(&mut self) {
        let mut g = self.table.lock();
        let done = match g.by_id.get_mut(&self.id) {
            Some(e) => {
                e.inflight -= 1;
                // A released grant waited only for this request.
                e.inflight == 0 && e.revoked && e.released()
            }
            None => false,
        };
        if done {
            g.remove(self.id);
        }
    }
}

impl<S> Entry<S> {
    /// Whether the peer may only read the pages.
    pub(crate) fn read_only(&self) -> bool {
        self.access == Access::Read
    }

    /// Released grants are revoked grants nobody waits on.
    fn released(&self) -> bool {
        self.pages.is_empty()
    }
}

impl<S> GrantTable<S> {
    fn lock(&self) -> MutexGuard<'_, Grants<S>> {
        self.grants.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a grant of `pages` to `peer` (`node`), for requests tagged `tag`.
    pub(crate) fn add(
        &self,
        node: &str,
        access: Access,
        tag: GrantTag,
        pages: &[BufferRef],
        session: S,
    ) -> GrantId {
        let id = GrantId(self.next.fetch_add(1, Ordering::Relaxed));
        let mut g = self.lock();
        for p in pages {
            g.by_page.entry(*p).or_default().push(id);
        }
        g.by_id.insert(
            id,
            Entry {
                node: node.to_string(),
                access,
                tag,
                pages: pages.to_vec(),
                revoked: false,
                inflight: 0,
                session,
            },
        );
        id
    }

    /// The peer reported it is done with the pages: forget the grant (at
    /// once, or when the requests still being served end). Returns whether
    /// the pages are free of the peer now: true unless a request is still
    /// being served in them (then [`GrantTable::settle`] says when). A read
    /// counts as much as a write: the server still copies out of the page,
    /// and the page must not go to a new owner (who writes it) meanwhile.
    pub(crate) fn release(&self, id: GrantId) -> bool {
        let mut g = self.lock();
        let pages = match g.by_id.get_mut(&id) {
            Some(e) if e.inflight > 0 => {
                e.revoked = true;
                std::mem::take(&mut e.pages)
            }
            Some(_) => {
                g.remove(id);
                return true;
            }
            None => return true,
        };
        // No new request may start under it; drop its page index now.
        for p in &pages {
            if let Some(v) = g.by_page.get_mut(p) {
                v.retain(|x| *x != id);
                if v.is_empty() {
                    g.by_page.remove(p);
                }
            }
        }
        false
    }

    /// Ends the grant without the peer's report: no new request may start
    /// under it; it stays known until [`GrantTable::settle`] finds it quiescent.
    pub(crate) fn revoke(&self, id: GrantId) {
        if let Some(e) = self.lock().by_id.get_mut(&id) {
            e.revoked = true;
        }
    }

    /// Whether revoked grant `id` is quiescent by `test`; a quiescent (or
    /// unknown) grant is forgotten and reported true. A live grant is never
    /// quiescent.
    pub(crate) fn settle(&self, id: GrantId, test: impl FnOnce(&Entry<S>) -> bool) -> bool {
        let mut g = self.lock();
        let quiet = match g.by_id.get(&id) {
            None => return true,
            Some(e) => e.revoked && e.inflight == 0 && test(e),
        };
        if quiet {
            g.remove(id);
        }
        quiet
    }

    /// Starts serving a request of `node` for `page` (a write when `write`)
    /// tagged `tag`: allowed only under a live grant of that peer with that
    /// access and that tag. A refusal is counted and logged once per node.
    pub(crate) fn begin(
        &self,
        node: &str,
        page: BufferRef,
        write: bool,
        tag: GrantTag,
    ) -> Result<Serving<'_, S>, String> {
        let mut g = self.lock();
        let found = g.by_page.get(&page).and_then(|ids| {
            ids.iter().copied().find(|id| {
                g.by_id.get(id).is_some_and(|e| {
                    !e.revoked && e.node == node && e.tag == tag && e.access.allows(write)
                })
            })
        });
        match found {
            Some(id) => {
                g.by_id.get_mut(&id).expect("found above").inflight += 1;
                Ok(Serving { table: self, id })
            }
            None => {
                drop(g);
                self.refused.fetch_add(1, Ordering::Relaxed);
                let what = if write { "write" } else { "read" };
                let first = self
                    .refused_logged
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(node.to_string());
                if first {
                    log::warn!(
                        "refused a {what} of page {page} by {node} ({tag}): no live grant of that \
                         peer with that tag covers it (its grant ended, was revoked or never \
                         made; later refusals of {node} are only counted)"
                    );
                }
                Err(format!(
                    "{what} of page {page} refused: {node} holds no live grant for it with {tag} \
                     (that grant ended or was revoked after its deadline, or it was never granted)"
                ))
            }
        }
    }

    /// The counters.
    pub(crate) fn stats(&self) -> GrantStats {
        let g = self.lock();
        let revoked = g.by_id.values().filter(|e| e.revoked).count();
        GrantStats {
            live: g.by_id.len() - revoked,
            revoked,
            refused: self.refused.load(Ordering::Relaxed),
            unauthenticated: 0,
            busy: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn page(n: u32) -> BufferRef {
        BufferRef {
            uuid: Uuid::from_u128(7),
            page: n,
        }
    }

    #[test]
    fn only_the_granted_peer_with_the_granted_access_is_served() {
        let t: GrantTable<()> = GrantTable::default();
        let g = t.add(
            "a",
            Access::Write,
            GrantTag::UNTAGGED,
            &[page(0), page(1)],
            (),
        );
        assert!(t.begin("a", page(0), true, GrantTag::UNTAGGED).is_ok());
        assert!(
            t.begin("a", page(0), false, GrantTag::UNTAGGED).is_err(),
            "write grant, read refused"
        );
        assert!(
            t.begin("b", page(1), true, GrantTag::UNTAGGED).is_err(),
            "other peer refused"
        );
        assert!(
            t.begin("a", page(2), true, GrantTag::UNTAGGED).is_err(),
            "ungranted page refused"
        );
        assert_eq!(t.stats().refused, 3);
        t.revoke(g);
        let e = t
            .begin("a", page(0), true, GrantTag::UNTAGGED)
            .err()
            .unwrap();
        assert!(
            e.contains("refused") && e.contains("a holds no live grant"),
            "{e}"
        );
        assert_eq!(t.stats().revoked, 1);
    }

    #[test]
    fn a_revoked_grant_is_quiescent_only_after_requests_in_flight_end() {
        let t: GrantTable<()> = GrantTable::default();
        let g = t.add("a", Access::Write, GrantTag::UNTAGGED, &[page(3)], ());
        let serving = t.begin("a", page(3), true, GrantTag::UNTAGGED).unwrap();
        assert!(!t.settle(g, |_| true), "live grant");
        t.revoke(g);
        assert!(!t.settle(g, |_| true), "a write is still being served");
        drop(serving);
        assert!(!t.settle(g, |_| false), "the channel's own test says no");
        assert!(t.settle(g, |_| true));
        assert_eq!(t.stats(), GrantStats::default());
        // Settled grants are forgotten: settling again is harmless.
        assert!(t.settle(g, |_| false));
    }

    #[test]
    fn released_grants_vanish_once_their_last_request_ends() {
        let t: GrantTable<()> = GrantTable::default();
        let g = t.add("a", Access::Read, GrantTag::UNTAGGED, &[page(1)], ());
        let h = t.add("b", Access::Read, GrantTag::UNTAGGED, &[page(1)], ());
        let serving = t.begin("a", page(1), false, GrantTag::UNTAGGED).unwrap();
        assert!(
            !t.release(g),
            "a read being served still copies out of the page: not free yet"
        );
        assert!(t.begin("a", page(1), false, GrantTag::UNTAGGED).is_err());
        assert!(
            t.begin("b", page(1), false, GrantTag::UNTAGGED).is_ok(),
            "the other grant stands"
        );
        drop(serving);
        assert!(t.settle(g, |_| false), "released: the peer's word suffices");
        assert!(t.release(h));
        assert_eq!(t.stats().live + t.stats().revoked, 0);
    }

    /// Review finding: the writer's `aborted` notice released its grant
    /// while the server still wrote a request the writer had given up on;
    /// the pages went back to the pool under that write. Release now says
    /// so, and the grant settles once the request ends.
    #[test]
    fn releasing_a_write_grant_under_a_request_in_flight_is_not_free_yet() {
        let t: GrantTable<()> = GrantTable::default();
        let g = t.add("a", Access::Write, GrantTag::UNTAGGED, &[page(2)], ());
        let serving = t.begin("a", page(2), true, GrantTag::UNTAGGED).unwrap();
        assert!(!t.release(g));
        assert!(
            t.begin("a", page(2), true, GrantTag::UNTAGGED).is_err(),
            "no new request"
        );
        assert!(!t.settle(g, |_| true), "still writing");
        drop(serving);
        assert!(t.settle(g, |_| false), "released: the peer's word suffices");
        assert_eq!(t.stats().live + t.stats().revoked, 0);
    }

    /// Review finding: a client gave up on a connection whose queued write
    /// for page P (allocation A) the server had not read yet; A ended, and
    /// P was granted to the same peer again for allocation B. The late
    /// request must not be served under B: it names A's tag.
    #[test]
    fn a_late_request_of_an_ended_grant_is_refused_under_the_pages_next_grant() {
        let t: GrantTable<()> = GrantTable::default();
        let a = GrantTag::of_route("w#4").unwrap();
        let b = GrantTag::of_route("w#5").unwrap();
        let first = t.add("w", Access::Write, a, &[page(1)], ());
        assert!(t.release(first));
        let _second = t.add("w", Access::Write, b, &[page(1)], ());
        let e = t
            .begin("w", page(1), true, a)
            .err()
            .expect("A's tag is refused");
        assert!(e.contains("with tag 4"), "{e}");
        assert!(t.begin("w", page(1), true, GrantTag::UNTAGGED).is_err());
        assert!(
            t.begin("w", page(1), true, b).is_ok(),
            "B's own write is served"
        );
        assert_eq!(t.stats().refused, 2);
    }

    #[test]
    fn tags_come_from_the_routes_number() {
        assert_eq!(
            GrantTag::of_route("host:1/p2r0-ab#17"),
            Some(GrantTag::new(17))
        );
        assert_eq!(GrantTag::of_route("a#b#3").and_then(GrantTag::get), Some(3));
        assert_eq!(GrantTag::of_route("no-number"), None);
        assert_eq!(GrantTag::of_route("x#"), None);
        assert_eq!(GrantTag::of_route("x#-1"), None);
    }
}
