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
//!
//! A cache described by [`KvStrides`] ([`strided_copies`]) gets the same
//! plan wherever its memory is contiguous, and otherwise one copy per
//! contiguous piece: with vLLM's CPU layout, one per `(layer, token, head,
//! element)` of K (stored transposed) and one per `(layer, token, head)` of
//! V. Copies are merged only where both the chunk's and the cache's bytes
//! continue.

use super::{KvCacheSpec, KvError, KvStrides};

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

/// One contiguous copy between a chunk and one plane of a cache laid out
/// by [`KvStrides`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlaneCopy {
    /// Byte offset in the chunk (from the start of its page).
    pub chunk_offset: usize,
    /// The plane: `layer * planes + plane` (0 = K, 1 = V; MLA: the layer).
    pub plane: usize,
    /// Byte offset from the plane's base.
    pub offset: usize,
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
    let plane_bytes = spec.plane_bytes();
    let copies = strided_copies(
        spec,
        &[KvStrides::contiguous(spec)],
        width,
        offset,
        tokens,
        slots,
    )?;
    Ok(copies
        .into_iter()
        .map(|c| CopyRun {
            chunk_offset: c.chunk_offset,
            cache_offset: c.plane * plane_bytes + c.offset,
            len: c.len,
        })
        .collect())
}

/// [`piece_copies`] for a cache whose planes are laid out by `strides`
/// (one per plane of a layer, or one shared by all; each checked with
/// [`KvStrides::check`]): each copy names its plane and the offset from
/// that plane's base. A piece is split wherever the plane's memory breaks
/// (at heads where heads are apart, at every element where elements are,
/// as in vLLM's CPU K); copies are merged wherever both the chunk's and the
/// plane's bytes continue, so contiguous strides give exactly the plan of
/// [`piece_copies`].
pub fn strided_copies(
    spec: &KvCacheSpec,
    strides: &[KvStrides],
    width: usize,
    offset: usize,
    tokens: usize,
    slots: &[i64],
) -> Result<Vec<PlaneCopy>, KvError> {
    layer_copies(spec, strides, width, offset, tokens, slots, 0..spec.layers)
}

/// [`strided_copies`] for the layers `layers` only (a layer-wise save
/// gathers one layer as soon as the engine wrote it); the copies are those
/// of the whole plan that fall in those layers.
pub fn layer_copies(
    spec: &KvCacheSpec,
    strides: &[KvStrides],
    width: usize,
    offset: usize,
    tokens: usize,
    slots: &[i64],
    layers: std::ops::Range<usize>,
) -> Result<Vec<PlaneCopy>, KvError> {
    if layers.end > spec.layers {
        return Err(KvError::InvalidSpec(format!(
            "layers {}..{} asked of a cache of {} layer(s)",
            layers.start, layers.end, spec.layers
        )));
    }
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
    let planes = spec.planes();
    if strides.len() != 1 && strides.len() != planes {
        return Err(KvError::InvalidStrides(format!(
            "{} strides given for {planes} plane(s) per layer: pass one per plane, or one \
             shared by all",
            strides.len()
        )));
    }
    let runs = token_runs(slots, spec.slots())?;
    let es = spec.dtype.size();
    let wb = width * es;
    let tb = spec.token_bytes();
    let whole = width == spec.hidden;
    let of_plane = |plane: usize| &strides[plane.min(strides.len() - 1)];
    // Reserved once: per-element layouts plan hundreds of thousands of
    // copies per chunk.
    let moved: usize = runs.iter().map(|r| r.len).sum();
    let per_layer: usize = (0..planes)
        .map(|p| {
            let unit = of_plane(p).dense_unit(spec);
            if unit < tb {
                moved * (wb / unit + 2)
            } else if whole {
                runs.len() + moved * tb / unit
            } else {
                moved
            }
        })
        .sum();
    let mut out: Vec<PlaneCopy> = Vec::with_capacity(per_layer * layers.len());
    let mut push = |c: PlaneCopy| match out.last_mut() {
        Some(l)
            if l.plane == c.plane
                && l.chunk_offset + l.len == c.chunk_offset
                && l.offset + l.len == c.offset =>
        {
            l.len += c.len
        }
        _ => out.push(c),
    };
    for plane in 0..planes {
        let st = of_plane(plane);
        for layer in layers.clone() {
            let index = layer * planes + plane;
            // Chunk: [plane][layer][token][width], `tokens` tokens per row.
            let row = (plane * spec.layers + layer) * tokens;
            // The chunk's bytes of a run (whole width) or of a token (a
            // piece) match a range of the plane's logical [slots][hidden]
            // byte for byte; the strides map that range to memory.
            let mut copy = |chunk_offset: usize, logical: usize, len: usize| {
                st.for_each_span(spec, logical, len, |at, pos, n| {
                    push(PlaneCopy {
                        chunk_offset: chunk_offset + pos,
                        plane: index,
                        offset: at,
                        len: n,
                    })
                })
            };
            for r in &runs {
                if whole {
                    copy((row + r.token) * wb, r.slot * tb, r.len * tb);
                    continue;
                }
                for j in 0..r.len {
                    copy(
                        (row + r.token + j) * wb,
                        (r.slot + j) * tb + offset * es,
                        wb,
                    );
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

    /// vLLM's CPU backend layout: 2 heads of 4 float16 elements, blocks of
    /// 4 tokens; a (block, head) cell is 2 × 4 × 4 × 2 = 64 bytes, K's 32
    /// (transposed: element e of token t at (e × 4 + t) × 2) then V's 32
    /// (token-major: at 32 + (t × 4 + e) × 2). Both planes: block_stride
    /// 128, head_stride 64; K token_stride 2, elem_stride 8; V token_stride
    /// 8, elem_stride 2, V's base K's + 32.
    fn vllm_cpu() -> (KvCacheSpec, [KvStrides; 2]) {
        let s = KvCacheSpec {
            layers: 2,
            hidden: 8,
            ..spec(MemFormat::Kv2Ltd)
        };
        (s, KvStrides::vllm_cpu(&s, 2).unwrap())
    }

    /// Where the CPU kernel keeps element `e` of head `h` of `slot` of a
    /// plane (0 = K, 1 = V), in bytes from its layer tensor's base, by the
    /// kernel's own rule; `V_BASE` is V's plane base in that tensor.
    fn cpu_kernel_offset(plane: usize, slot: usize, h: usize, e: usize) -> usize {
        let (heads, bs, hs, es) = (2, 4, 4, 2);
        let cell = ((slot / bs) * heads + h) * 2 * bs * hs;
        let t = slot % bs;
        let within = if plane == 0 {
            e * bs + t
        } else {
            bs * hs + t * hs + e
        };
        (cell + within) * es
    }
    const V_BASE: usize = 32;

    /// Checks every byte of a plan against the kernel's rule: chunk byte
    /// `[plane][layer][token][h·hs + e]` must land where the kernel keeps
    /// `(plane, slot, h, e)`, and every element of every token is copied
    /// once.
    fn assert_plan_is_the_kernels(
        copies: &[PlaneCopy],
        tokens: usize,
        slots: &[i64],
        width: usize,
        offset: usize,
    ) {
        let (layers, hs, es) = (2, 4, 2);
        let mut seen = std::collections::BTreeMap::new();
        for c in copies {
            let (layer, plane) = (c.plane / 2, c.plane % 2);
            let base = if plane == 0 { 0 } else { V_BASE };
            for b in 0..c.len {
                assert!(
                    seen.insert(c.chunk_offset + b, (layer, plane, base + c.offset + b))
                        .is_none(),
                    "chunk byte {} copied twice",
                    c.chunk_offset + b
                );
            }
        }
        let mut want = std::collections::BTreeMap::new();
        for plane in 0..2 {
            for layer in 0..layers {
                for (t, &slot) in slots.iter().enumerate().take(tokens) {
                    if slot < 0 {
                        continue;
                    }
                    for i in 0..width {
                        let (h, e) = ((offset + i) / hs, (offset + i) % hs);
                        let chunk = (((plane * layers + layer) * tokens + t) * width + i) * es;
                        let at = cpu_kernel_offset(plane, slot as usize, h, e);
                        for b in 0..es {
                            want.insert(chunk + b, (layer, plane, at + b));
                        }
                    }
                }
            }
        }
        assert_eq!(seen, want);
    }

    #[test]
    fn a_vllm_cpu_cache_is_one_copy_per_k_element_and_per_v_head() {
        let (s, st) = vllm_cpu();
        let [k, v] = st;
        assert_eq!(
            (k.block_stride, k.head_stride, k.token_stride, k.elem_stride),
            (128, 64, 2, 8)
        );
        assert_eq!(
            (v.block_stride, v.head_stride, v.token_stride, v.elem_stride),
            (128, 64, 8, 2)
        );
        // Slots 5 (block 1, token 1), 6 (block 1, token 2), 13 (block 3, token 1).
        let slots = [5, 6, 13];
        let copies = strided_copies(&s, &st, 8, 0, 3, &slots).unwrap();
        // K: per (layer, token, head, element); V: per (layer, token, head).
        assert_eq!(copies.len(), 2 * 3 * 2 * 4 + 2 * 3 * 2);
        assert!(copies[..48].iter().all(|c| c.len == 2), "{copies:?}");
        assert!(copies[48..].iter().all(|c| c.len == 8), "{copies:?}");
        let at = |chunk_offset, plane, offset, len| PlaneCopy {
            chunk_offset,
            plane,
            offset,
            len,
        };
        // Row (K, layer 0), token 0 = slot 5: element e of head h is chunk
        // bytes (h × 4 + e) × 2; in the plane 128 (block 1) + 2 (token 1)
        // + h × 64 + e × 8.
        assert_eq!(
            copies[..8],
            [
                at(0, 0, 130, 2),
                at(2, 0, 138, 2),
                at(4, 0, 146, 2),
                at(6, 0, 154, 2),
                at(8, 0, 194, 2),
                at(10, 0, 202, 2),
                at(12, 0, 210, 2),
                at(14, 0, 218, 2),
            ]
        );
        // Token 1 = slot 6 (token 2 of block 1): 2 bytes further in each cell.
        assert_eq!(copies[8], at(16, 0, 132, 2));
        // Row (V, layer 0) is the third of the chunk (K rows first): 2 × 3
        // tokens × 16 bytes in; plane index 1; slot 5's head 0 at 128 +
        // 8 (token 1 × 4 elements × 2 bytes), its head 1 a cell (64) on.
        // In the layer tensor that is V's base 32 further: 168 = (cell 2 ×
        // 32 elements + 16 + 1 × 4 + 0) × 2.
        assert_eq!(copies[48], at(96, 1, 136, 8));
        assert_eq!(copies[49], at(104, 1, 200, 8));
        assert_eq!(copies[48].offset + V_BASE, cpu_kernel_offset(1, 5, 0, 0));
        // Layer 1's V: plane 3, the last row of the chunk; slot 13 (block
        // 3, token 1), head 1.
        assert_eq!(copies[59], at(9 * 16 + 2 * 16 + 8, 3, 3 * 128 + 8 + 64, 8));
        assert_plan_is_the_kernels(&copies, 3, &slots, 8, 0);
        // Padding and runs across blocks change nothing of the above.
        let slots = [2, 3, -1, 4, 5, 15, 0];
        let copies = strided_copies(&s, &st, 8, 0, 7, &slots).unwrap();
        assert_eq!(copies.len(), 2 * 6 * 2 * 4 + 2 * 6 * 2);
        assert_plan_is_the_kernels(&copies, 7, &slots, 8, 0);
    }

    #[test]
    fn strided_plans_merge_only_what_is_contiguous_on_both_sides() {
        // One head of one element: consecutive tokens are contiguous in the
        // chunk (2 bytes apart) and in both planes (K's token_stride is the
        // element size, V's the head's): one copy per block piece of a run.
        let s = KvCacheSpec {
            layers: 2,
            hidden: 1,
            ..spec(MemFormat::Kv2Ltd)
        };
        let st = KvStrides::vllm_cpu(&s, 1).unwrap();
        assert_eq!((st[0].token_stride, st[0].block_stride), (2, 16));
        let copies = strided_copies(&s, &st, 1, 0, 4, &[2, 3, 4, 5]).unwrap();
        assert_eq!(copies.len(), 2 * 2 * 2);
        // Block 0 tokens 2..4, then block 1 (stride 16) tokens 0..2.
        assert_eq!(
            copies[..2],
            [
                PlaneCopy {
                    chunk_offset: 0,
                    plane: 0,
                    offset: 4,
                    len: 4
                },
                PlaneCopy {
                    chunk_offset: 4,
                    plane: 0,
                    offset: 16,
                    len: 4
                },
            ]
        );
        // One head of 4 elements: V's tokens of a block are contiguous, and
        // so is the chunk's run: one V copy per block piece; K stays one
        // per element (its tokens are 2 bytes apart, the chunk's 8).
        let s = KvCacheSpec {
            layers: 2,
            hidden: 4,
            ..spec(MemFormat::Kv2Ltd)
        };
        let st = KvStrides::vllm_cpu(&s, 1).unwrap();
        let copies = strided_copies(&s, &st, 4, 0, 4, &[2, 3, 4, 5]).unwrap();
        let v: Vec<&PlaneCopy> = copies.iter().filter(|c| c.plane % 2 == 1).collect();
        assert_eq!(v.len(), 2 * 2);
        // V's block 0 region: 32 bytes into the 64-byte cell, minus its base.
        assert_eq!(
            (v[0].offset, v[0].len, v[1].offset, v[1].len),
            (2 * 8, 16, 64, 16)
        );
        assert_eq!(copies.len() - v.len(), 2 * 4 * 4);
        // A piece across a head boundary: elements 2..8 are head 0's last 2
        // and head 1's 4. V: split at the head; K: one copy per element.
        let (s, st) = vllm_cpu();
        let copies = strided_copies(&s, &st, 6, 2, 1, &[5]).unwrap();
        let v: Vec<PlaneCopy> = copies.iter().copied().filter(|c| c.plane == 1).collect();
        assert_eq!(
            v,
            [
                PlaneCopy {
                    chunk_offset: 2 * 6 * 2,
                    plane: 1,
                    offset: 128 + 8 + 4,
                    len: 4
                },
                PlaneCopy {
                    chunk_offset: 2 * 6 * 2 + 4,
                    plane: 1,
                    offset: 128 + 8 + 64,
                    len: 8
                },
            ]
        );
        assert_eq!(copies.iter().filter(|c| c.plane == 0).count(), 6);
        assert_plan_is_the_kernels(&copies, 1, &[5], 6, 2);
        // Contiguous strides that name the heads and elements plan as the
        // contiguous cache.
        let named = KvStrides {
            num_heads: 2,
            head_size: 4,
            head_stride: 8,
            ..KvStrides::contiguous(&s)
        };
        named.check(&s).unwrap();
        let slots = [8, 9, 10, 3, -1, 4];
        let flat: Vec<CopyRun> = strided_copies(&s, &[named, named], 8, 0, 6, &slots)
            .unwrap()
            .into_iter()
            .map(|c| CopyRun {
                chunk_offset: c.chunk_offset,
                cache_offset: c.plane * s.plane_bytes() + c.offset,
                len: c.len,
            })
            .collect();
        assert_eq!(flat, chunk_copies(&s, 6, &slots).unwrap());
        let e = strided_copies(&s, &[named; 3], 8, 0, 6, &slots)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("3 strides given for 2 plane(s) per layer"),
            "{e}"
        );
    }

    /// A realistic per-element plan: 1024 tokens × 4 layers × 2 heads × 64
    /// elements of K, one copy each, plus V's one per head, planned in one
    /// allocation with every byte accounted for.
    #[test]
    fn a_large_per_element_plan_is_one_allocation() {
        let s = KvCacheSpec {
            fmt: MemFormat::Kv2Ltd,
            layers: 4,
            num_blocks: 80,
            block_size: 16,
            hidden: 128,
            dtype: Dtype::Float16,
        };
        let st = KvStrides::vllm_cpu(&s, 2).unwrap();
        let slots: Vec<i64> = (0..1024).collect();
        let start = std::time::Instant::now();
        let copies = strided_copies(&s, &st, 128, 0, 1024, &slots).unwrap();
        let took = start.elapsed();
        assert_eq!(copies.len(), 1024 * 4 * 128 + 1024 * 4 * 2);
        assert!(
            copies.capacity() - copies.len() <= 3 * 1024 * 4 * 2,
            "one reservation, near exact"
        );
        assert_eq!(
            copies.iter().map(|c| c.len).sum::<usize>(),
            2 * 4 * 1024 * 128 * 2
        );
        eprintln!("planned {} copies in {took:?}", copies.len());
    }
}
