//! Heterogeneous tensor parallelism: which KV heads each rank of the
//! prefill and the decode side holds, and which piece of a chunk goes from
//! which prefill rank to which decode rank. Plain arithmetic.
//!
//! Rank `r` of a side with TP size `T` holds heads
//! `[r * H / T, (r + 1) * H / T)` of the model's `H` KV heads. When the
//! prefill TP `A` is a multiple of the decode TP `B`, a decode rank
//! assembles its heads from `A / B` prefill ranks; when `B` is a multiple
//! of `A`, a decode rank takes its slice of one prefill rank's heads. MLA
//! caches one latent shared by all heads: every rank holds it whole, so it
//! is *replicated* — each decode rank takes it from one prefill rank.

use std::fmt;

/// KV heads `[start, end)` of the model's total.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadRange {
    /// First head.
    pub start: usize,
    /// One past the last head.
    pub end: usize,
}

impl HeadRange {
    /// Heads in the range.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether the range holds no head.
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }

    /// The heads both ranges hold (empty when they do not overlap).
    pub fn intersect(&self, other: &HeadRange) -> HeadRange {
        let start = self.start.max(other.start);
        HeadRange {
            start,
            end: self.end.min(other.end).max(start),
        }
    }
}

impl fmt::Display for HeadRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "heads [{}, {})", self.start, self.end)
    }
}

/// The key of the piece `heads` of the chunk `key` under heterogeneous TP
/// (each prefill rank sends its own pieces, so one chunk has one key per
/// piece). The request API names pieces this way on both sides.
pub fn piece_key(key: &str, heads: HeadRange) -> String {
    format!("{key}@heads{}-{}", heads.start, heads.end)
}

/// One piece of a chunk between a prefill and a decode rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    /// The rank on the other side.
    pub rank: usize,
    /// The heads the piece carries.
    pub heads: HeadRange,
}

/// How the KV heads of a model are split over a prefill and a decode side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpPlan {
    /// Prefill TP size.
    pub prefill_tp: usize,
    /// Decode TP size.
    pub decode_tp: usize,
    /// The model's KV heads (1 for a replicated MLA latent).
    pub total_heads: usize,
    /// Every rank holds every head (MLA).
    pub replicated: bool,
}

impl TpPlan {
    /// A plan, checked: both sizes at least 1, one a multiple of the
    /// other, and (unless replicated) the heads divisible by both.
    pub fn new(
        prefill_tp: usize,
        decode_tp: usize,
        total_heads: usize,
        replicated: bool,
    ) -> Result<TpPlan, String> {
        if prefill_tp == 0 || decode_tp == 0 {
            return Err("a TP size is 0; both sides need at least 1 rank".into());
        }
        let (hi, lo) = (prefill_tp.max(decode_tp), prefill_tp.min(decode_tp));
        if hi % lo != 0 {
            return Err(format!(
                "prefill TP {prefill_tp} and decode TP {decode_tp}: one must be a multiple of \
                 the other"
            ));
        }
        if total_heads == 0 {
            return Err("the model has 0 KV heads".into());
        }
        if !replicated && total_heads % hi != 0 {
            return Err(format!(
                "{total_heads} KV heads do not split evenly over TP {hi}; a rank must hold \
                 whole heads"
            ));
        }
        Ok(TpPlan {
            prefill_tp,
            decode_tp,
            total_heads,
            replicated,
        })
    }

    /// Whether the two sides differ in TP size.
    pub fn is_heterogeneous(&self) -> bool {
        self.prefill_tp != self.decode_tp
    }

    fn heads_of(&self, rank: usize, tp: usize) -> HeadRange {
        if self.replicated {
            return HeadRange {
                start: 0,
                end: self.total_heads,
            };
        }
        let per = self.total_heads / tp;
        HeadRange {
            start: rank * per,
            end: (rank + 1) * per,
        }
    }

    /// The heads prefill rank `p` holds.
    pub fn prefill_heads(&self, p: usize) -> HeadRange {
        self.heads_of(p, self.prefill_tp)
    }

    /// The heads decode rank `d` holds.
    pub fn decode_heads(&self, d: usize) -> HeadRange {
        self.heads_of(d, self.decode_tp)
    }

    /// The decode rank that takes a replicated chunk from prefill rank `p`
    /// (several prefill ranks hold the same latent: the first of each group
    /// sends), or the prefill rank a decode rank takes it from.
    fn replicated_source(&self, d: usize) -> usize {
        if self.prefill_tp >= self.decode_tp {
            d * (self.prefill_tp / self.decode_tp)
        } else {
            d / (self.decode_tp / self.prefill_tp)
        }
    }

    /// Where prefill rank `p` sends its chunks: each decode rank and the
    /// heads of the piece it gets, in rank order. Empty for a prefill rank
    /// whose replicated chunk another rank sends.
    pub fn targets(&self, p: usize) -> Vec<Route> {
        (0..self.decode_tp)
            .filter_map(|d| self.piece(p, d).map(|heads| Route { rank: d, heads }))
            .collect()
    }

    /// Where decode rank `d` takes its chunks from: each prefill rank and
    /// the heads of its piece, in rank order. Together they cover
    /// [`TpPlan::decode_heads`] once.
    pub fn sources(&self, d: usize) -> Vec<Route> {
        (0..self.prefill_tp)
            .filter_map(|p| self.piece(p, d).map(|heads| Route { rank: p, heads }))
            .collect()
    }

    /// The heads prefill rank `p` sends decode rank `d`, if any.
    pub fn piece(&self, p: usize, d: usize) -> Option<HeadRange> {
        if p >= self.prefill_tp || d >= self.decode_tp {
            return None;
        }
        if self.replicated {
            return (self.replicated_source(d) == p).then(|| self.decode_heads(d));
        }
        let heads = self.prefill_heads(p).intersect(&self.decode_heads(d));
        (!heads.is_empty()).then_some(heads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(start: usize, end: usize) -> HeadRange {
        HeadRange { start, end }
    }

    #[test]
    fn a_decode_rank_assembles_its_heads_from_several_prefill_ranks() {
        let t = TpPlan::new(4, 2, 8, false).unwrap();
        assert_eq!(t.decode_heads(1), r(4, 8));
        let s: Vec<_> = t.sources(1).iter().map(|x| (x.rank, x.heads)).collect();
        assert_eq!(s, vec![(2, r(4, 6)), (3, r(6, 8))]);
        assert_eq!(
            t.targets(3),
            vec![Route {
                rank: 1,
                heads: r(6, 8)
            }]
        );
    }

    #[test]
    fn a_decode_rank_takes_its_slice_of_one_prefill_rank() {
        let t = TpPlan::new(1, 2, 8, false).unwrap();
        assert_eq!(t.targets(0).len(), 2);
        assert_eq!(t.targets(0)[1].heads, r(4, 8));
        assert_eq!(
            t.sources(1),
            vec![Route {
                rank: 0,
                heads: r(4, 8)
            }]
        );
    }

    #[test]
    fn a_replicated_latent_goes_once_to_every_decode_rank() {
        for (a, b) in [(4, 2), (2, 4), (2, 2), (1, 4)] {
            let t = TpPlan::new(a, b, 1, true).unwrap();
            let mut got = vec![0; b];
            for p in 0..a {
                for route in t.targets(p) {
                    assert_eq!(route.heads, r(0, 1));
                    got[route.rank] += 1;
                }
            }
            assert_eq!(got, vec![1; b], "A={a} B={b}");
            for d in 0..b {
                assert_eq!(t.sources(d).len(), 1);
            }
        }
        // Prefill ranks 1 and 3 of TP 4 -> 2 hold what ranks 0 and 2 send.
        let t = TpPlan::new(4, 2, 1, true).unwrap();
        assert!(t.targets(1).is_empty() && t.targets(3).is_empty());
    }

    #[test]
    fn sources_tile_every_decode_rank_and_agree_with_targets() {
        for (a, b) in [
            (1, 1),
            (2, 1),
            (1, 2),
            (4, 1),
            (1, 4),
            (4, 2),
            (2, 4),
            (8, 8),
        ] {
            let t = TpPlan::new(a, b, 8, false).unwrap();
            for d in 0..b {
                let mut at = t.decode_heads(d).start;
                for s in t.sources(d) {
                    assert_eq!(s.heads.start, at, "A={a} B={b} d={d}: a gap or overlap");
                    at = s.heads.end;
                    assert!(t.targets(s.rank).contains(&Route {
                        rank: d,
                        heads: s.heads
                    }));
                }
                assert_eq!(at, t.decode_heads(d).end);
            }
            let sent: usize = (0..a)
                .flat_map(|p| t.targets(p))
                .map(|x| x.heads.len())
                .sum();
            assert_eq!(sent, 8, "every head is sent exactly once");
        }
    }

    #[test]
    fn sizes_that_do_not_divide_are_refused_with_the_reason() {
        let e = TpPlan::new(3, 2, 6, false).unwrap_err();
        assert!(e.contains("multiple"), "{e}");
        let e = TpPlan::new(4, 1, 2, false).unwrap_err();
        assert!(
            e.contains("2 KV heads do not split evenly over TP 4"),
            "{e}"
        );
        assert!(TpPlan::new(4, 1, 2, true).is_ok());
        assert!(TpPlan::new(0, 1, 2, false).is_err());
        assert_eq!(
            TpPlan::new(4, 4, 1, true).unwrap().piece(3, 3),
            Some(r(0, 1))
        );
    }
}
