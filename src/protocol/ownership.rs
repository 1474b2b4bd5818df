//! Who holds each stored key of a receiver, who is about to, and when a key
//! may go: the one copy of the shared-prefix rule. Every path that could
//! drop a key asks here — a load giving a proxy up or ending its read, a
//! release after a load, a cancel, an eviction, the resident TTL — so no
//! path can drop a key another request still holds, or one a newcomer's
//! sender was just told is already here.
//!
//! Plain data, no I/O and no clock of its own: [`super::receiver::ReceiverCore`]
//! owns one and says which keys are stored.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// Requests remembered per key; beyond this the key is simply kept until
/// the others release it or it is removed.
const MAX_HOLDERS: usize = 4096;

/// The holders, claims and resident clocks of a receiver's stored keys.
#[derive(Debug, Default)]
pub(crate) struct KeyOwnership {
    /// The requests holding each stored key, by the `req_id` their
    /// `AllocRequest` / `PullReadyNotif` carried ("" when it carried none,
    /// as from LMCache-Ascend peers). A key several requests share (a
    /// deduplicated prefix) stays until each named request released it;
    /// the same request announcing it again counts once. A stored key
    /// with no entry has one anonymous holder.
    holders: HashMap<String, HashSet<String>>,
    /// Keys a plan found present, by the number of such plans not yet
    /// committed or given up. A request told "already sent" must find the
    /// key when it loads, so a claimed key outlives its last holder's
    /// release until the claim ends: kept for the claimant on commit,
    /// dropped after all if every claimant gave up.
    claims: HashMap<String, u32>,
    /// When the resident sweep first saw each resident key (its
    /// `pd_resident_ttl` counts from there).
    resident_since: HashMap<String, Instant>,
}

impl KeyOwnership {
    /// `key` was just stored for request `req`: its only holder.
    pub(crate) fn hold_new(&mut self, key: &str, req: &str) {
        self.holders
            .insert(key.to_string(), HashSet::from([req.to_string()]));
    }

    /// Request `req` takes on `key`, stored before. It gets the whole
    /// resident TTL to load it: the clock restarts at the next sweep.
    pub(crate) fn hold_present(&mut self, key: &str, req: &str) {
        self.resident_since.remove(key);
        let h = self.holders.entry(key.to_string()).or_default();
        if h.len() < MAX_HOLDERS {
            h.insert(req.to_string());
        }
    }

    /// `key` left the store: its holders and clock go with it (a claim
    /// stays, ended by its plan).
    pub(crate) fn forget(&mut self, key: &str) {
        self.holders.remove(key);
        self.resident_since.remove(key);
    }

    /// Requests holding the stored `key`.
    pub(crate) fn holders(&self, key: &str) -> usize {
        self.holders.get(key).map_or(1, HashSet::len)
    }

    /// Whether a plan not yet ended claimed `key`.
    pub(crate) fn is_claimed(&self, key: &str) -> bool {
        self.claims.contains_key(key)
    }

    /// The rule: whether the stored `key` must stay for someone besides
    /// one of its holders — another holder, or a plan that claimed it.
    pub(crate) fn wanted_by_others(&self, key: &str) -> bool {
        self.holders(key) > 1 || self.is_claimed(key)
    }

    /// Lets go of `req`'s hold on the stored `key` when the key must stay
    /// for others ([`KeyOwnership::wanted_by_others`]), and returns true;
    /// returns false (nothing changed) when `req`'s going would leave the
    /// key to nobody, so the caller removes it. When `req` is not among
    /// the holders (the decode side names its requests differently from
    /// the prefill side), one hold goes anyway, an anonymous one first:
    /// with one release per request, a key still goes after its last.
    ///
    /// A claimed key stays even with no hold left: its holders are then an
    /// empty set until the claim ends ([`KeyOwnership::unclaim`]).
    pub(crate) fn let_go(&mut self, key: &str, req: &str) -> bool {
        if !self.wanted_by_others(key) {
            return false;
        }
        // A key stored without a named hold has one anonymous hold; make
        // it explicit so dropping it leaves an empty set.
        self.holders
            .entry(key.to_string())
            .or_insert_with(|| HashSet::from([String::new()]));
        self.drop_hold(key, req);
        true
    }

    /// Removes `req`'s hold on `key` (or, if it has none by that name, one
    /// hold, an anonymous one first), whoever else holds it: for a key
    /// still landing whose last request is cancelled (a request that
    /// takes it on before it lands keeps it).
    pub(crate) fn drop_hold(&mut self, key: &str, req: &str) {
        if let Some(h) = self.holders.get_mut(key) {
            if !h.remove(req) {
                let any = h
                    .iter()
                    .find(|r| r.is_empty())
                    .or_else(|| h.iter().next())
                    .cloned();
                if let Some(a) = any {
                    h.remove(&a);
                }
            }
        }
    }

    /// A plan found `key` stored: it stays until the plan is committed or
    /// given up, whoever else lets go meanwhile.
    pub(crate) fn claim(&mut self, key: &str) {
        *self.claims.entry(key.to_string()).or_default() += 1;
    }

    /// Ends one plan's claim on `key`. Returns whether the key is now an
    /// orphan that must go: the plan was given up (`kept` false), nobody
    /// else claims it, and every holder let go while it was claimed.
    pub(crate) fn unclaim(&mut self, key: &str, kept: bool) -> bool {
        if let Some(n) = self.claims.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                self.claims.remove(key);
            }
        }
        !kept && !self.is_claimed(key) && self.holders.get(key).is_some_and(HashSet::is_empty)
    }

    /// Whether the resident `key` has been resident for `ttl` as of `now`
    /// (the clock starts at the first sweep that sees it). A claimed key is
    /// about to be announced "already sent": never late while claimed (the
    /// claimant's commit takes it on, which restarts the clock).
    pub(crate) fn resident_late(&mut self, key: &str, now: Instant, ttl: Duration) -> bool {
        if self.is_claimed(key) {
            return false;
        }
        match self.resident_since.get(key) {
            None => {
                self.resident_since.insert(key.to_string(), now);
                false
            }
            Some(&since) => now.saturating_duration_since(since) >= ttl,
        }
    }

    /// Keeps the holders of the keys `stored` says are still stored.
    pub(crate) fn retain_stored(&mut self, stored: impl Fn(&str) -> bool) {
        self.holders.retain(|k, _| stored(k));
        self.resident_since.retain(|k, _| stored(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_key_stays_until_its_last_holder_and_any_claim_end() {
        let mut o = KeyOwnership::default();
        o.hold_new("k", "a");
        o.hold_present("k", "b");
        assert!(o.wanted_by_others("k"));
        assert!(o.let_go("k", "a"), "b still holds it");
        assert!(!o.wanted_by_others("k"));
        assert!(
            !o.let_go("k", "b"),
            "the last holder: the caller removes it"
        );

        // A claim keeps a key whose holders all let go; a given-up plan
        // then leaves an orphan, a committed one does not.
        o.hold_new("p", "a");
        o.claim("p");
        assert!(o.wanted_by_others("p"));
        assert!(o.let_go("p", "a"));
        assert_eq!(o.holders("p"), 0);
        assert!(o.unclaim("p", false), "nobody left: it goes");
        o.hold_new("q", "a");
        o.claim("q");
        assert!(o.let_go("q", "a"));
        assert!(!o.unclaim("q", true), "kept for the claimant");
    }

    #[test]
    fn an_unnamed_release_drops_an_anonymous_hold_first() {
        let mut o = KeyOwnership::default();
        o.hold_new("k", "");
        o.hold_present("k", "named");
        assert!(o.let_go("k", "decode-side-id"));
        assert!(!o.let_go("k", "named"), "the named holder is the last");
    }

    #[test]
    fn the_resident_clock_starts_at_first_sight_and_spares_claimed_keys() {
        let mut o = KeyOwnership::default();
        let (t, ttl) = (Instant::now(), Duration::from_secs(10));
        o.hold_new("k", "a");
        assert!(!o.resident_late("k", t, ttl));
        assert!(o.resident_late("k", t + ttl, ttl));
        o.hold_present("k", "b");
        assert!(!o.resident_late("k", t + ttl, ttl), "restarted for b");
        o.claim("k");
        assert!(!o.resident_late("k", t + 5 * ttl, ttl), "claimed");
        o.unclaim("k", true);
        assert!(o.resident_late("k", t + 5 * ttl, ttl));
    }
}
