//! Copy planning for scatter and gather: which byte ranges of a chunk go
//! to which byte ranges of the KV cache. Plain arithmetic, no memory.
//!
//! A chunk is `[planes, layers, tokens, hidden]` (K and V planes for
//! `KV_2LTD`, one latent plane for MLA); the cache is
//! `[layers][planes][num_blocks * block_size][hidden]`. Token `t` of the
//! chunk lands at slot `slots[t]` of every `(layer, plane)`. Tokens whose
//! slots are consecutive form one run, and a run is one copy per
//! `(layer, plane)`, so a vLLM block table with whole blocks in order turns
//! into a handful of large copies instead of one copy per token.

use super::{KvCacheSpec, KvError};

/// One contiguous copy between a chunk and the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRun {
    /// Byte offset in the chunk (from the start of its page).
    pub chunk_offset: usize,
    /// Byte offset in the cache.
    pub cache_offset: usize,
    /// Bytes to copy.
    pub len: usize,
}

/// A run of tokens with consecutive slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenRun {
    /// First token (index into the chunk).
    pub token: usize,
    /// Slot of that token.
    pub slot: usize,
    /// Tokens in the run.
    pub len: usize,
}

/// Coalesces `slots` (one per token; negative = padding, skipped, as vLLM's
/// `PAD_SLOT_ID`) into runs of consecutive slots. Every slot must be below
/// `num_slots`.
pub fn token_runs(slots: &[i64], num_slots: usize) -> Result<Vec<TokenRun>, KvError> {
    let mut runs: Vec<TokenRun> = Vec::new();
    for (t, &s) in slots.iter().enumerate() {
        if s < 0 {
            continue;
        }
        let slot = usize::try_from(s).unwrap_or(usize::MAX);
        if slot >= num_slots {
            return Err(KvError::SlotOutOfRange {
                token: t,
                slot: s,
                slots: num_slots,
            });
        }
        match runs.last_mut() {
            Some(r) if r.token + r.len == t && r.slot + r.len == slot => r.len += 1,
            _ => runs.push(TokenRun {
                token: t,
                slot,
                len: 1,
            }),
        }
    }
    Ok(runs)
}

/// The copies that move a chunk of `tokens` tokens to (scatter) or from
/// (gather) the slots `slots` of a cache shaped `spec`.
/// `slots.len()` must equal `tokens`.
pub fn chunk_copies(
    spec: &KvCacheSpec,
    tokens: usize,
    slots: &[i64],
) -> Result<Vec<CopyRun>, KvError> {
    piece_copies(spec, spec.hidden, 0, tokens, slots)
}

/// [`chunk_copies`] for a head piece: the chunk holds `width` elements per
/// token, which are elements `[offset, offset + width)` of a cache token.
/// A whole-width piece coalesces runs of slots; a narrower one is one copy
/// per token (its elements are strided in the cache).
pub fn piece_copies(
    spec: &KvCacheSpec,
    width: usize,
    offset: usize,
    tokens: usize,
    slots: &[i64],
) -> Result<Vec<CopyRun>, KvError> {
    if slots.len() != tokens {
        return Err(KvError::SlotCount {
            tokens,
            slots: slots.len(),
        });
    }
    if offset
        .checked_add(width)
        .is_none_or(|end| end > spec.hidden)
        || width == 0
    {
        return Err(KvError::InvalidSpec(format!(
            "a piece of {width} element(s) at element {offset} does not fit a token of \
             {} element(s)",
            spec.hidden
        )));
    }
    let runs = token_runs(slots, spec.slots())?;
    let es = spec.dtype.size();
    let tb = width * es;
    let whole = width == spec.hidden;
    let planes = spec.planes();
    let per_row = if whole {
        runs.len()
    } else {
        runs.iter().map(|r| r.len).sum()
    };
    let mut out = Vec::with_capacity(per_row * planes * spec.layers);
    for plane in 0..planes {
        for layer in 0..spec.layers {
            // Chunk: [plane][layer][token][width], `tokens` tokens per row.
            let row = (plane * spec.layers + layer) * tokens;
            for r in &runs {
                if whole {
                    out.push(CopyRun {
                        chunk_offset: (row + r.token) * tb,
                        cache_offset: spec.offset(layer, plane, r.slot),
                        len: r.len * tb,
                    });
                    continue;
                }
                for j in 0..r.len {
                    out.push(CopyRun {
                        chunk_offset: (row + r.token + j) * tb,
                        cache_offset: spec.offset(layer, plane, r.slot + j) + offset * es,
                        len: tb,
                    });
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Dtype, MemFormat};

    fn spec(fmt: MemFormat) -> KvCacheSpec {
        KvCacheSpec {
            fmt,
            layers: 3,
            num_blocks: 4,
            block_size: 4,
            hidden: 2,
            dtype: Dtype::Float16,
        }
    }

    #[test]
    fn consecutive_slots_coalesce_and_padding_is_skipped() {
        let runs = token_runs(&[4, 5, 6, 7, 0, 1, -1, 9, 12], 16).unwrap();
        assert_eq!(
            runs,
            vec![
                TokenRun {
                    token: 0,
                    slot: 4,
                    len: 4
                },
                TokenRun {
                    token: 4,
                    slot: 0,
                    len: 2
                },
                TokenRun {
                    token: 7,
                    slot: 9,
                    len: 1
                },
                TokenRun {
                    token: 8,
                    slot: 12,
                    len: 1
                },
            ]
        );
        // A padded token breaks a run even when the slots around it are consecutive.
        assert_eq!(token_runs(&[2, -1, 3], 16).unwrap().len(), 2);
        let e = token_runs(&[0, 16], 16).unwrap_err().to_string();
        assert!(e.contains("token 1") && e.contains("16"), "{e}");
    }

    #[test]
    fn copies_cover_every_layer_and_plane_once_per_run() {
        for fmt in [MemFormat::Kv2Ltd, MemFormat::Mla] {
            let s = spec(fmt);
            let slots = [8, 9, 10, 3];
            let copies = chunk_copies(&s, 4, &slots).unwrap();
            assert_eq!(copies.len(), 2 * s.layers * s.planes());
            let total: usize = copies.iter().map(|c| c.len).sum();
            assert_eq!(total, s.planes() * s.layers * 4 * s.token_bytes());
            // The last (plane, layer) row's second run: token 3 -> slot 3.
            let last = copies.last().unwrap();
            let tb = s.token_bytes();
            assert_eq!(
                last.chunk_offset,
                ((s.planes() * s.layers - 1) * 4 + 3) * tb
            );
            assert_eq!(last.cache_offset, s.offset(s.layers - 1, s.planes() - 1, 3));
        }
        let e = chunk_copies(&spec(MemFormat::Mla), 4, &[1, 2])
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 slot(s) for 4 token(s)"), "{e}");
    }

    #[test]
    fn a_head_piece_lands_in_its_elements_of_each_slot() {
        let s = KvCacheSpec {
            hidden: 8,
            ..spec(MemFormat::Kv2Ltd)
        };
        // A 2-element piece at element 4: one copy per token, strided.
        let copies = piece_copies(&s, 2, 4, 3, &[5, 6, -1]).unwrap();
        assert_eq!(copies.len(), 2 * s.layers * s.planes());
        let es = s.dtype.size();
        assert_eq!(
            copies[1],
            CopyRun {
                chunk_offset: 2 * es,
                cache_offset: s.offset(0, 0, 6) + 4 * es,
                len: 2 * es,
            }
        );
        // The second row of the chunk (plane 0, layer 1) starts 3 tokens in.
        assert_eq!(copies[2].chunk_offset, 3 * 2 * es);
        // A whole-width piece is the ordinary plan.
        assert_eq!(
            piece_copies(&s, 8, 0, 3, &[5, 6, -1]).unwrap(),
            chunk_copies(&s, 3, &[5, 6, -1]).unwrap()
        );
        let e = piece_copies(&s, 4, 6, 1, &[0]).unwrap_err().to_string();
        assert!(e.contains("4 element(s) at element 6"), "{e}");
    }
}
