//! A deterministic byte pattern for verifying transferred data end to end.
//!
//! Every 8-byte word is a hash of `(seed, word index)`, so a misplaced,
//! truncated or stale page is detected, not just a corrupted byte.

/// The word at `index` of the pattern for `seed` (splitmix64).
fn word(seed: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of page `page` of a run seeded `seed`.
pub fn page_seed(seed: u64, page: u64) -> u64 {
    word(seed, page.wrapping_add(1 << 40))
}

/// Fills `buf` with the pattern for `seed`.
pub fn fill(buf: &mut [u8], seed: u64) {
    let mut chunks = buf.chunks_exact_mut(8);
    for (i, c) in chunks.by_ref().enumerate() {
        c.copy_from_slice(&word(seed, i as u64).to_le_bytes());
    }
    let i = buf.len() / 8;
    let rest = buf.len() % 8;
    if rest > 0 {
        let w = word(seed, i as u64).to_le_bytes();
        buf[i * 8..].copy_from_slice(&w[..rest]);
    }
}

/// Fills `buf` with bytes `[offset, offset + buf.len())` of the pattern for
/// `seed`: a slice of a larger buffer [`fill`] would write (a head piece
/// of a chunk, one row at a time).
pub fn fill_at(buf: &mut [u8], seed: u64, offset: usize) {
    let mut at = 0;
    while at < buf.len() {
        let b = offset + at;
        let (w, skip) = (b / 8, b % 8);
        let bytes = word(seed, w as u64).to_le_bytes();
        let n = (8 - skip).min(buf.len() - at);
        buf[at..at + n].copy_from_slice(&bytes[skip..skip + n]);
        at += n;
    }
}

/// The offset of the first byte of `buf` that differs from the pattern, if any.
pub fn first_mismatch(buf: &[u8], seed: u64) -> Option<usize> {
    let mut chunks = buf.chunks_exact(8);
    for (i, c) in chunks.by_ref().enumerate() {
        if c != word(seed, i as u64).to_le_bytes() {
            let w = word(seed, i as u64).to_le_bytes();
            let j = c.iter().zip(w).position(|(a, b)| *a != b).unwrap_or(0);
            return Some(i * 8 + j);
        }
    }
    let i = buf.len() / 8;
    let rest = chunks.remainder();
    let w = word(seed, i as u64).to_le_bytes();
    rest.iter()
        .zip(w)
        .position(|(a, b)| *a != b)
        .map(|j| i * 8 + j)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_of_the_pattern_is_the_same_bytes_at_any_offset() {
        let mut whole = vec![0u8; 200];
        fill(&mut whole, 9);
        for (from, len) in [(0, 200), (8, 16), (3, 50), (61, 1), (199, 1)] {
            let mut part = vec![0u8; len];
            fill_at(&mut part, 9, from);
            assert_eq!(part, whole[from..from + len], "at {from}");
        }
    }

    #[test]
    fn pattern_round_trips_and_detects_changes() {
        for len in [0, 1, 7, 8, 9, 4096 + 3] {
            let mut b = vec![0u8; len];
            fill(&mut b, 42);
            assert_eq!(first_mismatch(&b, 42), None, "len {len}");
            if len > 0 {
                assert_eq!(first_mismatch(&b, 43).map(|i| i < 8), Some(true));
                b[len - 1] ^= 1;
                assert_eq!(first_mismatch(&b, 42), Some(len - 1));
            }
        }
        assert_ne!(page_seed(1, 0), page_seed(1, 1));
    }
}
