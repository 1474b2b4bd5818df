//! A bounded set of recently seen ids with a value, a lifetime and a hard
//! capacity (oldest evicted first). The sender uses it for early
//! `PullDoneSignal`s and for recently released pulls, so neither can grow
//! without bound no matter what peers send.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// Ids remembered for at most `lifetime` and at most `capacity` at once.
#[derive(Debug)]
pub struct RecentIds<V> {
    capacity: usize,
    lifetime: Duration,
    next_seq: u64,
    /// id -> (insertion sequence, expiry, value)
    by_id: HashMap<String, (u64, Instant, V)>,
    /// insertion sequence -> id; with one lifetime for all, also expiry order.
    by_age: BTreeMap<u64, String>,
    evicted: u64,
}

impl<V> RecentIds<V> {
    /// An empty set. A `capacity` of 0 remembers nothing.
    pub fn new(capacity: usize, lifetime: Duration) -> RecentIds<V> {
        RecentIds {
            capacity,
            lifetime,
            next_seq: 0,
            by_id: HashMap::new(),
            by_age: BTreeMap::new(),
            evicted: 0,
        }
    }

    /// Remembers `id` with `value` until `now + lifetime` (replacing an
    /// older record of the same id), evicting the oldest ids beyond capacity.
    pub fn insert(&mut self, id: &str, value: V, now: Instant) {
        self.expire(now);
        if self.capacity == 0 {
            return;
        }
        if let Some((seq, _, _)) = self.by_id.remove(id) {
            self.by_age.remove(&seq);
        }
        while self.by_id.len() >= self.capacity {
            let Some((_, oldest)) = self.by_age.pop_first() else {
                break;
            };
            self.by_id.remove(&oldest);
            self.evicted += 1;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.by_age.insert(seq, id.to_owned());
        self.by_id
            .insert(id.to_owned(), (seq, now + self.lifetime, value));
    }

    /// The value of `id` if it is remembered and not expired at `now`.
    pub fn get(&self, id: &str, now: Instant) -> Option<&V> {
        match self.by_id.get(id) {
            Some((_, expires, v)) if now < *expires => Some(v),
            _ => None,
        }
    }

    /// Forgets `id`, whatever its age.
    pub fn forget(&mut self, id: &str) {
        if let Some((seq, _, _)) = self.by_id.remove(id) {
            self.by_age.remove(&seq);
        }
    }

    /// Removes `id`, returning its value if it was remembered and not expired.
    pub fn take(&mut self, id: &str, now: Instant) -> Option<V> {
        let (seq, expires, v) = self.by_id.remove(id)?;
        self.by_age.remove(&seq);
        (now < expires).then_some(v)
    }

    /// Forgets every id whose lifetime has passed at `now`; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let mut n = 0;
        while let Some((&seq, id)) = self.by_age.first_key_value() {
            match self.by_id.get(id) {
                Some((_, expires, _)) if now < *expires => break,
                _ => {
                    self.by_id.remove(id);
                    self.by_age.remove(&seq);
                    n += 1;
                }
            }
        }
        n
    }

    /// Ids currently remembered (expired ones included until the next expiry pass).
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    #[cfg(test)]
    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    #[cfg(test)]
    /// The hard capacity.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    #[cfg(test)]
    /// Ids forgotten because the capacity was reached (not by expiry).
    pub fn evicted(&self) -> u64 {
        self.evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_ids_capacity_evicts_oldest_and_lifetime_expires() {
        let t0 = Instant::now();
        let mut s: RecentIds<u32> = RecentIds::new(3, Duration::from_secs(10));
        for i in 0..5 {
            s.insert(&format!("id{i}"), i, t0);
        }
        assert_eq!(s.len(), 3);
        assert_eq!(s.evicted(), 2);
        assert!(s.get("id0", t0).is_none() && s.get("id1", t0).is_none());
        assert_eq!(s.get("id4", t0), Some(&4));
        // Re-inserting refreshes the age: id2 is now the youngest.
        s.insert("id2", 22, t0 + Duration::from_secs(5));
        s.insert("new", 9, t0 + Duration::from_secs(5));
        assert_eq!(s.get("id2", t0 + Duration::from_secs(5)), Some(&22));
        assert!(s.get("id3", t0).is_none());
        // Expiry.
        assert!(s.get("id4", t0 + Duration::from_secs(10)).is_none());
        assert_eq!(s.expire(t0 + Duration::from_secs(10)), 1);
        assert_eq!(s.take("id2", t0 + Duration::from_secs(6)), Some(22));
        assert_eq!(s.take("id2", t0 + Duration::from_secs(6)), None);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn recent_ids_zero_capacity_remembers_nothing() {
        let t0 = Instant::now();
        let mut s: RecentIds<()> = RecentIds::new(0, Duration::from_secs(1));
        s.insert("a", (), t0);
        assert!(s.is_empty());
        assert_eq!(s.capacity(), 0);
    }
}
