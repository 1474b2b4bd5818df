//! Pricing a pull-delay load's reads on a modeled Ascend link, to choose
//! between its two ways of reaching the KV cache:
//!
//! - **direct**: one one-sided read per contiguous run of the cache (with
//!   vLLM-Ascend's layout, one per layer, plane and block run; adjacent
//!   runs merged first, see [`coalesce`]);
//! - **staged**: one read per chunk, of its whole page, then a scatter on
//!   the receiver's own device.
//!
//! Both move the same bytes over the link; they differ in op sizes, and the
//! link's throughput depends on op size (HCCL's communication domain on A2
//! RoCE moves 16 KiB ops at under 4% of its 2 MiB rate: see
//! [`ascend_sys::link`]). The staged path pays a device-local scatter as
//! well, which the table does not price; it overlaps the next micro-batch's
//! read (ping-pong pages). So the direct path is taken while its modeled
//! link time is at most [`DIRECT_TOLERANCE`] times the staged path's: then
//! neither choice is modeled at more than that factor slower than the
//! other, and the direct path saves the scatter and the staging pages.
//!
//! Pure functions of the op sizes and the table: the same inputs choose
//! the same path on any machine.

use crate::channel::{DirectRead, LinkPath};
use ascend_sys::link::{Direction, Link};
use std::fmt;

/// How much slower (modeled link time) a direct load may be than the staged
/// one and still be taken.
pub(crate) const DIRECT_TOLERANCE: f64 = 1.10;

/// Merges each read into the one before it when both read the same remote
/// page, the second's range starts where the first's ends, and so does its
/// destination: one op instead of two, same bytes in the same places.
pub(crate) fn coalesce(ops: &mut Vec<DirectRead>) {
    let mut out: Vec<DirectRead> = Vec::with_capacity(ops.len());
    for op in ops.drain(..) {
        match out.last_mut() {
            Some(last)
                if last.remote == op.remote
                    && last.offset + last.len == op.offset
                    && last.dst + last.len == op.dst =>
            {
                last.len += op.len;
            }
            _ => out.push(op),
        }
    }
    *ops = out;
}

/// The modeled link time of both ways to load a set of proxies.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PathPrice {
    /// The link's name.
    pub link: &'static str,
    /// The channel's path on it.
    pub path: LinkPath,
    /// Ops of the direct load (after coalescing).
    pub direct_ops: usize,
    /// The smallest of them, in bytes.
    pub smallest_op: usize,
    /// Modeled seconds of the direct load's ops.
    pub direct_s: f64,
    /// Ops of the staged load (one per chunk page).
    pub staged_ops: usize,
    /// Modeled seconds of the staged load's ops.
    pub staged_s: f64,
}

impl PathPrice {
    /// Prices `direct` (the direct load's reads, coalesced) against one
    /// read of each of `staged` bytes; `None` when the link has no curve
    /// for `path`'s reads.
    pub(crate) fn of(
        link: &'static Link,
        path: LinkPath,
        direct: &[DirectRead],
        staged: impl IntoIterator<Item = usize>,
    ) -> Option<PathPrice> {
        let curve = link.curve(path, Direction::Read)?;
        let secs = |n: usize| curve.op_seconds(n as u64);
        let mut staged_ops = 0;
        let mut staged_s = 0.0;
        for n in staged {
            staged_ops += 1;
            staged_s += secs(n);
        }
        Some(PathPrice {
            link: link.name(),
            path,
            direct_ops: direct.len(),
            smallest_op: direct.iter().map(|o| o.len).min().unwrap_or(0),
            direct_s: direct.iter().map(|o| secs(o.len)).sum(),
            staged_ops,
            staged_s,
        })
    }

    /// Whether the direct load is taken (see the module documentation).
    pub(crate) fn direct_wins(&self) -> bool {
        self.direct_s <= self.staged_s * DIRECT_TOLERANCE
    }

    /// `"direct"` or `"staged"`.
    pub(crate) fn choice(&self) -> &'static str {
        if self.direct_wins() {
            "direct"
        } else {
            "staged"
        }
    }
}

impl fmt::Display for PathPrice {
    /// Why the choice was made, for the log and the load report.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |s: f64| s * 1e3;
        write!(
            f,
            "{}: modeled on {} ({:?} reads): direct {} op(s), smallest {} B, {:.3} ms; \
             staged {} page read(s), {:.3} ms (plus a device scatter); direct is taken \
             up to {DIRECT_TOLERANCE}x the staged time",
            self.choice(),
            self.link,
            self.path,
            self.direct_ops,
            self.smallest_op,
            ms(self.direct_s),
            self.staged_ops,
            ms(self.staged_s),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::BufferRef;
    use ascend_sys::link::Table;
    use uuid::Uuid;

    const KIB: usize = 1024;
    const MIB: usize = 1024 * KIB;

    fn link(name: &str) -> &'static Link {
        Table::builtin().link(name).unwrap()
    }

    fn page(n: u32) -> BufferRef {
        BufferRef {
            uuid: Uuid::from_u128(7),
            page: n,
        }
    }

    /// `runs` reads of `len` bytes from one page, each landing `gap` bytes
    /// after the previous one's end (0: contiguous in the cache too).
    fn runs(remote: BufferRef, runs: usize, len: usize, gap: usize) -> Vec<DirectRead> {
        (0..runs)
            .map(|i| DirectRead {
                remote,
                offset: i * len,
                dst: 0x10_0000 + i * (len + gap),
                len,
            })
            .collect()
    }

    #[test]
    fn coalescing_merges_only_ranges_adjacent_on_both_ends() {
        let mut ops = runs(page(1), 8, 4 * KIB, 0);
        coalesce(&mut ops);
        assert_eq!(ops, runs(page(1), 1, 32 * KIB, 0));

        // Apart in the cache: nothing merges.
        let mut apart = runs(page(1), 8, 4 * KIB, 64);
        let before = apart.clone();
        coalesce(&mut apart);
        assert_eq!(apart, before);

        // Another page, or a gap in the remote range: no merge either.
        let mut two = runs(page(1), 2, KIB, 0);
        two[1].remote = page(2);
        coalesce(&mut two);
        assert_eq!(two.len(), 2);
        let mut skip = runs(page(1), 2, KIB, 0);
        skip[1].offset += 1;
        skip[1].dst += 1;
        coalesce(&mut skip);
        assert_eq!(skip.len(), 2);

        // Bytes are kept whatever merges.
        let mut mixed = runs(page(3), 6, 3 * KIB, 0);
        mixed.extend(runs(page(4), 3, KIB, 10));
        let total: usize = mixed.iter().map(|o| o.len).sum();
        coalesce(&mut mixed);
        assert_eq!(mixed.len(), 4);
        assert_eq!(mixed.iter().map(|o| o.len).sum::<usize>(), total);
    }

    #[test]
    fn a2_roce_comm_stages_small_runs_and_reads_large_ones_directly() {
        let l = link("a2-roce");
        let chunk = 32 * MIB;
        // 256-token chunks of a Llama-3-8B-shaped cache in 16-token blocks:
        // 32 KiB runs, 1024 of them per chunk.
        let small = runs(page(1), chunk / (32 * KIB), 32 * KIB, 64);
        let p = PathPrice::of(l, LinkPath::Comm, &small, [chunk]).unwrap();
        assert!(!p.direct_wins(), "{p}");
        assert_eq!(p.choice(), "staged");
        assert_eq!(
            (p.direct_ops, p.smallest_op, p.staged_ops),
            (1024, 32 * KIB, 1)
        );
        // 2 MiB runs run at the link's top rate: direct.
        let large = runs(page(1), chunk / (2 * MIB), 2 * MIB, 64);
        let p = PathPrice::of(l, LinkPath::Comm, &large, [chunk]).unwrap();
        assert!(p.direct_wins(), "{p}");
        let text = p.to_string();
        assert!(text.starts_with("direct: modeled on a2-roce"), "{text}");
    }

    #[test]
    fn the_hixl_path_reads_block_runs_directly_where_the_comm_path_stages_them() {
        // vLLM-Ascend's block of 128 tokens, 2 KiB per token and plane:
        // 256 KiB runs.
        let l = link("a2-roce");
        let ops = runs(page(1), 128, 256 * KIB, 64);
        let comm = PathPrice::of(l, LinkPath::Comm, &ops, [32 * MIB]).unwrap();
        let hixl = PathPrice::of(l, LinkPath::Hixl, &ops, [32 * MIB]).unwrap();
        assert_eq!((comm.choice(), hixl.choice()), ("staged", "direct"));
    }

    #[test]
    fn the_choice_is_never_modeled_more_than_the_tolerance_slower() {
        let chunk = 8 * MIB;
        for name in Table::builtin().names() {
            for path in [LinkPath::Comm, LinkPath::Hixl] {
                for run in [512, 4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB] {
                    let ops = runs(page(1), chunk / run, run, 1);
                    let p = PathPrice::of(link(name), path, &ops, [chunk]).unwrap();
                    let (taken, other) = if p.direct_wins() {
                        (p.direct_s, p.staged_s)
                    } else {
                        (p.staged_s, p.direct_s)
                    };
                    assert!(taken <= other * DIRECT_TOLERANCE, "{name} {p}");
                }
            }
        }
    }
}
