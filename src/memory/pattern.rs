//! A deterministic byte pattern for verifying transferred data end to end.
//!
//! Word `i` (8 bytes, little-endian) of the pattern for `seed` is
//! `TABLE[i mod 2^16] ^ block(seed, i / 2^16)`: a fixed table of 512 KiB
//! of splitmix64 words, XORed with one hash per 512 KiB block of the
//! buffer and seed. A misplaced, shifted, truncated or stale range is
//! detected (another seed or block changes every word, a shift within a
//! block meets other table words), not just a corrupted byte; and making
//! or checking it is a load and an XOR per word, so the bench's stand-in
//! for the model runs near memory speed instead of bounding what it
//! measures.

use std::sync::OnceLock;

/// Table words (a power of two).
const TABLE_WORDS: usize = 1 << 16;

/// splitmix64 of `(seed, index)`.
fn mix(seed: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn table() -> &'static [u64] {
    static TABLE: OnceLock<Box<[u64]>> = OnceLock::new();
    TABLE.get_or_init(|| (0..TABLE_WORDS as u64).map(|i| mix(0x7ab1e, i)).collect())
}

/// The value XORed into the table words of block `block` for `seed`.
fn block_word(seed: u64, block: u64) -> u64 {
    mix(seed, block.wrapping_add(1 << 41))
}

/// Word `index` of the pattern for `seed`.
fn word(seed: u64, index: u64) -> u64 {
    table()[index as usize % TABLE_WORDS] ^ block_word(seed, index / TABLE_WORDS as u64)
}

/// The seed of page `page` of a run seeded `seed`.
pub fn page_seed(seed: u64, page: u64) -> u64 {
    mix(seed, page.wrapping_add(1 << 40))
}

/// Calls `f(at, words, x)` for `n_words` words of the pattern from word
/// `first_word` on, in pieces that stay within one table block: the
/// piece starts `at` words in, its words are `words[j] ^ x`.
fn for_each_piece(
    seed: u64,
    first_word: usize,
    n_words: usize,
    mut f: impl FnMut(usize, &[u64], u64),
) {
    let t = table();
    let mut done = 0;
    while done < n_words {
        let w = first_word + done;
        let in_block = w % TABLE_WORDS;
        let n = (TABLE_WORDS - in_block).min(n_words - done);
        f(
            done,
            &t[in_block..in_block + n],
            block_word(seed, (w / TABLE_WORDS) as u64),
        );
        done += n;
    }
}

/// Writes whole words `[first_word, first_word + buf.len() / 8)` of the
/// pattern into `buf` (a multiple of 8 bytes).
fn fill_words(buf: &mut [u8], seed: u64, first_word: usize) {
    for_each_piece(seed, first_word, buf.len() / 8, |at, words, x| {
        let out = &mut buf[at * 8..(at + words.len()) * 8];
        for (o, w) in out.chunks_exact_mut(8).zip(words) {
            o.copy_from_slice(&(w ^ x).to_le_bytes());
        }
    });
}

/// The first byte of `buf` that differs from whole words from
/// `first_word` on of the pattern (`buf` a multiple of 8 bytes).
fn mismatch_words(buf: &[u8], seed: u64, first_word: usize) -> Option<usize> {
    let mut found = None;
    for_each_piece(seed, first_word, buf.len() / 8, |at, words, x| {
        if found.is_some() {
            return;
        }
        let have = &buf[at * 8..(at + words.len()) * 8];
        // Branch-free over runs of 64 words (vectorised), then the exact
        // byte in the run that differs.
        for (run, (h, w)) in have.chunks(512).zip(words.chunks(64)).enumerate() {
            let diff = h.chunks_exact(8).zip(w).fold(0u64, |d, (b, w)| {
                d | (u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) ^ w ^ x)
            });
            if diff != 0 {
                let base = (at + run * 64) * 8;
                found = h
                    .iter()
                    .zip(w.iter().flat_map(|w| (w ^ x).to_le_bytes()))
                    .position(|(a, b)| *a != b)
                    .map(|j| base + j);
                return;
            }
        }
    });
    found
}

/// Fills `buf` with the pattern for `seed`.
pub fn fill(buf: &mut [u8], seed: u64) {
    fill_at(buf, seed, 0);
}

/// Fills `buf` with bytes `[offset, offset + buf.len())` of the pattern for
/// `seed`: a slice of a larger buffer [`fill`] would write (a token run of
/// a chunk written straight into a KV cache).
pub fn fill_at(buf: &mut [u8], seed: u64, offset: usize) {
    let head = ((8 - offset % 8) % 8).min(buf.len());
    let (h, rest) = buf.split_at_mut(head);
    if head > 0 {
        let w = word(seed, (offset / 8) as u64).to_le_bytes();
        h.copy_from_slice(&w[offset % 8..offset % 8 + head]);
    }
    let first = (offset + head) / 8;
    let whole = rest.len() / 8 * 8;
    let (body, tail) = rest.split_at_mut(whole);
    fill_words(body, seed, first);
    if !tail.is_empty() {
        let w = word(seed, (first + whole / 8) as u64).to_le_bytes();
        let n = tail.len();
        tail.copy_from_slice(&w[..n]);
    }
}

/// The offset in `buf` of its first byte that differs from bytes
/// `[offset, offset + buf.len())` of the pattern for `seed`, if any.
pub fn mismatch_at(buf: &[u8], seed: u64, offset: usize) -> Option<usize> {
    let head = ((8 - offset % 8) % 8).min(buf.len());
    let mut want = [0u8; 8];
    if head > 0 {
        fill_at(&mut want[..head], seed, offset);
        if let Some(j) = buf[..head].iter().zip(&want).position(|(a, b)| a != b) {
            return Some(j);
        }
    }
    let whole = (buf.len() - head) / 8 * 8;
    if let Some(j) = mismatch_words(&buf[head..head + whole], seed, (offset + head) / 8) {
        return Some(head + j);
    }
    let tail = &buf[head + whole..];
    fill_at(&mut want[..tail.len()], seed, offset + head + whole);
    tail.iter()
        .zip(&want)
        .position(|(a, b)| a != b)
        .map(|j| head + whole + j)
}

/// The offset of the first byte of `buf` that differs from the pattern, if any.
pub fn first_mismatch(buf: &[u8], seed: u64) -> Option<usize> {
    mismatch_at(buf, seed, 0)
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

    #[test]
    fn pieces_across_table_blocks_match_the_whole_and_every_flip_is_found() {
        // Three table blocks and a bit: pieces start and end inside
        // blocks and words.
        let len = 3 * TABLE_WORDS * 8 + 13;
        let mut whole = vec![0u8; len];
        fill(&mut whole, 5);
        for (from, n) in [
            (1, TABLE_WORDS * 8),
            (TABLE_WORDS * 8 - 3, 11),
            (7, len - 7),
        ] {
            let mut part = vec![0u8; n];
            fill_at(&mut part, 5, from);
            assert_eq!(part[..], whole[from..from + n], "at {from}");
            assert_eq!(mismatch_at(&part, 5, from), None, "at {from}");
            for flip in [0, n / 2, n - 1] {
                part[flip] ^= 0x10;
                assert_eq!(
                    mismatch_at(&part, 5, from),
                    Some(flip),
                    "at {from}, flip {flip}"
                );
                part[flip] ^= 0x10;
            }
        }
    }

    #[test]
    fn a_shifted_block_or_another_seeds_bytes_do_not_pass() {
        let n = 2 * TABLE_WORDS * 8;
        let mut a = vec![0u8; n + TABLE_WORDS * 8];
        fill(&mut a, 1);
        // A whole table block later, or a word later, in the same seed.
        assert!(mismatch_at(&a[TABLE_WORDS * 8..], 1, 0).is_some());
        assert!(mismatch_at(&a[8..n], 1, 0).is_some());
        // Another seed at the same offset: every word differs.
        let mut b = vec![0u8; n];
        fill(&mut b, 2);
        let differ = a[..n]
            .chunks_exact(8)
            .zip(b.chunks_exact(8))
            .filter(|(x, y)| x != y)
            .count();
        assert_eq!(differ, n / 8);
    }
}
