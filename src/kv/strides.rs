//! KV caches described by byte strides: the layouts engines other than
//! vLLM-Ascend hand a connector (see [`KvStrides`]), the checks that keep
//! every plane's elements apart, and the map from a plane's logical
//! `[slots][hidden]` bytes to its memory.

use super::{KvCacheSpec, KvError, KvTensor};

/// How the elements of one kind of plane of a KV cache (K, V, or the MLA
/// latent) lie in memory: byte strides, applied to that plane of every
/// layer. A cache takes one per plane of a layer (K and V may differ, as
/// in vLLM's CPU backend), or one shared by both.
///
/// A plane is `num_blocks × block_size × num_heads × head_size` elements,
/// and element `(block b, token t of the block, head h, element e)` lives at
/// `base + b·block_stride + t·token_stride + h·head_stride + e·elem_stride`;
/// each plane has its own base. That covers:
///
/// - vLLM-Ascend's per-layer K and V `[num_blocks, block_size, heads, head]`
///   and MLA's latent (one "head" of the latent size): the
///   [contiguous](KvStrides::contiguous) layout, the one [`KvCache`] uses
///   for its own memory;
/// - the stacked `[2, num_blocks, block_size, heads, head]` of GPU backends:
///   contiguous strides, V's base `num_blocks · block_size · hidden · es`
///   after K's ([`KvStrides::stacked_planes`]);
/// - vLLM's CPU backend (its `vec` and `vec16` kernels), one `[num_blocks,
///   heads, block_size, 2·head_size]` tensor per layer that holds, for each
///   (block, head), K's `block_size × head_size` elements transposed
///   (element e of token t at `e·block_size + t`) and then V's token-major
///   (at `t·head_size + e`): K and V with different strides,
///   [`KvStrides::vllm_cpu`] and [`KvStrides::vllm_cpu_planes`].
///
/// Chunks keep one layout whatever the cache's (`[planes][layers][tokens]
/// [hidden]`); the copy planner ([`strided_copies`]) maps each token's
/// elements to the cache through the strides, one copy per piece that is
/// contiguous on both sides (per element where elements are apart).
///
/// [`KvCache`]: super::KvCache
/// [`strided_copies`]: super::plan::strided_copies
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvStrides {
    /// KV heads per token (1 for an MLA latent).
    pub num_heads: usize,
    /// Elements per head (the latent size for MLA); `num_heads × head_size`
    /// is the cache's `hidden`.
    pub head_size: usize,
    /// Bytes from one block to the next.
    pub block_stride: usize,
    /// Bytes from one token of a block to the next.
    pub token_stride: usize,
    /// Bytes from one head of a token to the next.
    pub head_stride: usize,
    /// Bytes from one element of a head to the next: the element size when
    /// a head's elements are contiguous.
    pub elem_stride: usize,
}

/// One dimension of a plane: its name, size and byte stride.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dim {
    name: &'static str,
    size: usize,
    stride: usize,
}

/// `(n - 1) · stride + inner`: the bytes `n` cells of `inner` bytes span,
/// `stride` apart.
fn span_of(n: usize, stride: usize, inner: usize) -> Option<usize> {
    (n - 1).checked_mul(stride)?.checked_add(inner)
}

/// Refuses a layer tensor count that is not one per layer.
fn one_per_layer(spec: &KvCacheSpec, layers: &[KvTensor], what: &str) -> Result<(), KvError> {
    if layers.len() == spec.layers {
        return Ok(());
    }
    Err(KvError::InvalidSpec(format!(
        "{} tensor(s) given for {} layers: {what} takes one tensor per layer, in layer order",
        layers.len(),
        spec.layers
    )))
}

impl KvStrides {
    /// The contiguous layout: each plane `[num_blocks, block_size, hidden]`
    /// with nothing between elements (vLLM-Ascend's per-layer K and V, an
    /// MLA latent, each half of a stacked `[2, ...]` tensor). Heads are
    /// contiguous, so the layout is described as one head of `hidden`
    /// elements.
    pub fn contiguous(spec: &KvCacheSpec) -> KvStrides {
        let tb = spec.token_bytes();
        KvStrides {
            num_heads: 1,
            head_size: spec.hidden,
            block_stride: spec.block_size * tb,
            token_stride: tb,
            head_stride: tb,
            elem_stride: spec.dtype.size(),
        }
    }

    /// The planes of stacked layer tensors (one `[2, num_blocks,
    /// block_size, hidden]` per layer, as GPU backends keep them): K at the
    /// tensor's base and V one plane later, each with the bytes left in
    /// the tensor from there. With [`KvStrides::contiguous`], what
    /// [`KvCache::wrap_host_strided`](super::KvCache::wrap_host_strided)
    /// takes.
    pub fn stacked_planes(
        spec: &KvCacheSpec,
        layers: &[KvTensor],
    ) -> Result<Vec<KvTensor>, KvError> {
        one_per_layer(spec, layers, "the stacked layout")?;
        let step = spec.plane_bytes();
        Ok(layers
            .iter()
            .flat_map(|t| {
                (0..spec.planes()).map(move |p| KvTensor {
                    addr: t.addr.saturating_add((p * step) as u64),
                    bytes: t.bytes.saturating_sub(p * step),
                })
            })
            .collect())
    }

    /// vLLM's CPU backend (`cpu_attn_reshape_and_cache`, ISAs `vec` and
    /// `vec16`): one `[num_blocks, num_heads, block_size, 2 · head_size]`
    /// tensor per layer. Each (block, head) is a cell of `2 · block_size ·
    /// head_size` elements: first K's `block_size × head_size`, stored
    /// transposed (element e of token t at `e · block_size + t`), then V's,
    /// token-major (at `t · head_size + e`). With `es` the element size,
    /// `N` heads, `bs` the block size and `hs` the head size, both planes
    /// have `block_stride = N · 2 · bs · hs · es` and `head_stride = 2 · bs
    /// · hs · es`; K has `token_stride = es`, `elem_stride = bs · es`, V
    /// `token_stride = hs · es`, `elem_stride = es`. Returns `[K, V]`; the
    /// plane bases are [`KvStrides::vllm_cpu_planes`].
    ///
    /// Each element of K is then its own copy (a chunk holds a token's
    /// elements side by side), which is fine on the host; on an NPU the
    /// layout is refused.
    pub fn vllm_cpu(spec: &KvCacheSpec, num_heads: usize) -> Result<[KvStrides; 2], KvError> {
        let head_size = Self::vllm_cpu_head_size(spec, num_heads)?;
        let es = spec.dtype.size();
        let region = spec.block_size * head_size * es;
        let shared = KvStrides {
            num_heads,
            head_size,
            block_stride: num_heads * 2 * region,
            token_stride: 0,
            head_stride: 2 * region,
            elem_stride: 0,
        };
        Ok([
            KvStrides {
                token_stride: es,
                elem_stride: spec.block_size * es,
                ..shared
            },
            KvStrides {
                token_stride: head_size * es,
                elem_stride: es,
                ..shared
            },
        ])
    }

    /// The plane bases of vLLM's CPU layer tensors (one per layer, in layer
    /// order, see [`KvStrides::vllm_cpu`]): for each layer K at the
    /// tensor's base and V `block_size · head_size · es` bytes later (the
    /// end of K's region of the first (block, head)), each with the bytes
    /// left in the tensor from there.
    pub fn vllm_cpu_planes(
        spec: &KvCacheSpec,
        num_heads: usize,
        layers: &[KvTensor],
    ) -> Result<Vec<KvTensor>, KvError> {
        let head_size = Self::vllm_cpu_head_size(spec, num_heads)?;
        one_per_layer(spec, layers, "vLLM's CPU layout")?;
        let v = spec.block_size * head_size * spec.dtype.size();
        Ok(layers
            .iter()
            .flat_map(|t| {
                [
                    *t,
                    KvTensor {
                        addr: t.addr.saturating_add(v as u64),
                        bytes: t.bytes.saturating_sub(v),
                    },
                ]
            })
            .collect())
    }

    fn vllm_cpu_head_size(spec: &KvCacheSpec, num_heads: usize) -> Result<usize, KvError> {
        if spec.planes() != 2 {
            return Err(KvError::InvalidStrides(
                "vLLM's CPU layout holds K and V planes; an MLA cache has one plane per layer: \
                 describe it with KvStrides directly"
                    .into(),
            ));
        }
        if num_heads == 0 || spec.hidden % num_heads != 0 {
            return Err(KvError::InvalidStrides(format!(
                "{num_heads} KV head(s) do not divide the cache's hidden size {}: pass the \
                 number of KV heads per plane",
                spec.hidden
            )));
        }
        Ok(spec.hidden / num_heads)
    }

    /// Whether each token's `hidden` elements are one contiguous run
    /// (elements of a head side by side, and heads side by side): then
    /// copies are at least a token, as an NPU cache needs.
    pub fn token_contiguous(&self, spec: &KvCacheSpec) -> bool {
        self.dense_unit(spec) >= spec.token_bytes()
    }

    /// The plane's dimensions of more than one element, innermost (smallest
    /// stride) first; on equal strides the order element, head, token,
    /// block.
    fn dims(&self, spec: &KvCacheSpec) -> Vec<Dim> {
        let mut dims: Vec<Dim> = [
            Dim {
                name: "elem_stride",
                size: self.head_size,
                stride: self.elem_stride,
            },
            Dim {
                name: "head_stride",
                size: self.num_heads,
                stride: self.head_stride,
            },
            Dim {
                name: "token_stride",
                size: spec.block_size,
                stride: self.token_stride,
            },
            Dim {
                name: "block_stride",
                size: spec.num_blocks,
                stride: self.block_stride,
            },
        ]
        .into_iter()
        .filter(|d| d.size > 1)
        .collect();
        dims.sort_by_key(|d| d.stride);
        dims
    }

    /// Checks the strides against `spec`: no zero dimension, `num_heads ×
    /// head_size = hidden`, strides multiples of the element size, and no
    /// two elements of a plane sharing a byte. The last is proven on the
    /// dimensions ordered by stride, whatever their names (vLLM's CPU K has
    /// tokens inside elements): each stride at least the bytes the
    /// dimensions of smaller stride span; strides that interleave otherwise
    /// are refused. Returns the bytes a plane spans from its base to past
    /// its last element.
    pub fn check(&self, spec: &KvCacheSpec) -> Result<usize, KvError> {
        spec.validate()?;
        let bad = |s: String| Err(KvError::InvalidStrides(s));
        let es = spec.dtype.size();
        if self.num_heads == 0 || self.head_size == 0 {
            return bad(format!(
                "num_heads {} and head_size {} must both be at least 1",
                self.num_heads, self.head_size
            ));
        }
        if self.num_heads.checked_mul(self.head_size) != Some(spec.hidden) {
            return bad(format!(
                "num_heads {} × head_size {} is not the cache's hidden size {}: pass the KV \
                 heads of one plane and the elements of one head (the MLA latent: 1 head of \
                 the latent size)",
                self.num_heads, self.head_size, spec.hidden
            ));
        }
        let strides = [
            (
                "block_stride",
                self.block_stride,
                "num_blocks",
                spec.num_blocks,
            ),
            (
                "token_stride",
                self.token_stride,
                "block_size",
                spec.block_size,
            ),
            ("head_stride", self.head_stride, "num_heads", self.num_heads),
            ("elem_stride", self.elem_stride, "head_size", self.head_size),
        ];
        for (name, stride, dim, size) in strides {
            if stride % es != 0 {
                return bad(format!(
                    "{name} {stride} is not a multiple of the {es}-byte {} element: strides \
                     are in bytes, multiples of the element size",
                    spec.dtype
                ));
            }
            if stride == 0 && size > 1 {
                return bad(format!(
                    "{name} is 0 but {dim} is {size}: they would all share the same bytes; \
                     pass the distance in bytes from one to the next"
                ));
            }
        }
        let head_bytes = self.head_size * es;
        if self.elem_stride == es && self.num_heads > 1 && self.head_stride < head_bytes {
            return bad(format!(
                "head_stride {} is smaller than one head ({} elements × {es} bytes = \
                 {head_bytes}): heads would overlap; for heads stored side by side pass \
                 head_stride {head_bytes}",
                self.head_stride, self.head_size
            ));
        }
        let mut span = es;
        let mut inner: Vec<&str> = vec!["one element"];
        for d in self.dims(spec) {
            if d.stride < span {
                return bad(format!(
                    "{} {} is smaller than the {span} bytes spanned by the dimensions of smaller \
                     stride ({}): two elements of a plane would share bytes; check the strides \
                     and which dimension each belongs to",
                    d.name,
                    d.stride,
                    inner.join(", ")
                ));
            }
            span = span_of(d.size, d.stride, span).ok_or_else(|| {
                KvError::InvalidStrides(format!(
                    "{} {} × {} overflows a byte count",
                    d.name, d.stride, d.size
                ))
            })?;
            inner.push(d.name);
        }
        Ok(span)
    }

    /// The bytes of a plane's logical `[slots][hidden]` layout that are
    /// one contiguous run in memory, from any multiple of that many bytes:
    /// an element, a head, a token, a block, or the whole plane.
    pub(crate) fn dense_unit(&self, spec: &KvCacheSpec) -> usize {
        let es = spec.dtype.size();
        let head = self.head_size * es;
        let token = spec.token_bytes();
        let block = spec.block_size * token;
        if self.head_size > 1 && self.elem_stride != es {
            es
        } else if self.num_heads > 1 && self.head_stride != head {
            head
        } else if spec.block_size > 1 && self.token_stride != token {
            token
        } else if spec.num_blocks > 1 && self.block_stride != block {
            block
        } else {
            spec.plane_bytes()
        }
    }

    /// Maps `len` bytes at byte `at` of a plane's logical `[slots][hidden]`
    /// layout to memory: `f(offset from the plane's base, position in the
    /// range, bytes)` for each contiguous piece, in order. The range must
    /// lie in the plane (`at + len <= spec.plane_bytes()`).
    pub(crate) fn for_each_span(
        &self,
        spec: &KvCacheSpec,
        at: usize,
        len: usize,
        mut f: impl FnMut(usize, usize, usize),
    ) {
        debug_assert!(at + len <= spec.plane_bytes(), "a range crosses a plane");
        let unit = self.dense_unit(spec);
        let token = spec.token_bytes();
        let bs = spec.block_size;
        let slot_offset =
            |slot: usize| (slot / bs) * self.block_stride + (slot % bs) * self.token_stride;
        let mut done = 0;
        if unit >= token {
            // Whole tokens are runs: pieces of `unit` bytes.
            while done < len {
                let pos = at + done;
                let n = (unit - pos % unit).min(len - done);
                f(slot_offset(pos / token) + pos % token, done, n);
                done += n;
            }
            return;
        }
        // Heads or elements apart: walk each token's heads, and their
        // elements where those are apart too (vLLM's CPU K: one piece per
        // element).
        let es = spec.dtype.size();
        let head = self.head_size * es;
        let per_element = unit < head;
        let (mut slot, mut from) = (at / token, at % token);
        while done < len {
            let base = slot_offset(slot);
            let to = from + (token - from).min(len - done);
            let (mut h, mut in_head) = (from / head, from % head);
            let mut p = from;
            while p < to {
                let head_base = base + h * self.head_stride;
                if per_element {
                    let (mut e, mut b) = (in_head / es, in_head % es);
                    while p < to && e < self.head_size {
                        let n = (es - b).min(to - p);
                        f(head_base + e * self.elem_stride + b, done, n);
                        done += n;
                        p += n;
                        e += 1;
                        b = 0;
                    }
                } else {
                    let n = (head - in_head).min(to - p);
                    f(head_base + in_head, done, n);
                    done += n;
                    p += n;
                }
                h += 1;
                in_head = 0;
            }
            slot += 1;
            from = 0;
        }
    }
}

/// A plane's kind: "K", "V" or "latent".
fn kind_name(spec: &KvCacheSpec, plane: usize) -> &'static str {
    match (spec.planes(), plane % spec.planes()) {
        (1, _) => "latent",
        (_, 0) => "K",
        _ => "V",
    }
}

/// A plane's name in messages: its index, layer and kind.
fn plane_name(spec: &KvCacheSpec, i: usize) -> String {
    format!("{i} (layer {} {})", i / spec.planes(), kind_name(spec, i))
}

/// One [`KvStrides`] per plane of a layer, from `strides` (one per plane,
/// or one shared by all), each checked ([`KvStrides::check`]); with the
/// bytes each spans.
pub(crate) fn per_plane(
    spec: &KvCacheSpec,
    strides: &[KvStrides],
) -> Result<Vec<(KvStrides, usize)>, KvError> {
    let planes = spec.planes();
    if strides.len() != 1 && strides.len() != planes {
        return Err(KvError::InvalidStrides(format!(
            "{} strides given: pass {}",
            strides.len(),
            if planes == 2 {
                "2 (K's, then V's) or 1 shared by K and V"
            } else {
                "1 (the MLA latent's)"
            }
        )));
    }
    (0..planes)
        .map(|p| {
            let st = strides[p.min(strides.len() - 1)];
            match st.check(spec) {
                Ok(span) => Ok((st, span)),
                Err(KvError::InvalidStrides(m)) if strides.len() > 1 => Err(
                    KvError::InvalidStrides(format!("{} plane: {m}", kind_name(spec, p))),
                ),
                Err(e) => Err(e),
            }
        })
        .collect()
}

/// Whether planes `a` and `b`, with `b`'s base `offset` bytes at or after
/// `a`'s, provably share no byte. The proof: take dimensions both have
/// alike (same stride and size; outermost ones, the smallest of their
/// strides the *cell*) that nest (each stride at least the span of the
/// common ones inside it, one cell to start), so each address has one
/// cell origin and one position in its cell. If each plane's remaining
/// dimensions keep its elements, from its base, inside one cell, and the
/// two in-cell ranges do not overlap, no element byte of `a` can be one of
/// `b`'s. (vLLM's CPU layout: common block and head dimensions, a cell of
/// `2 · bs · hs · es` bytes, K's elements in its first half, V's — based
/// `bs · hs · es` later — in its second.) Anything else is refused.
fn planes_apart(a: &[Dim], b: &[Dim], offset: usize, es: usize) -> bool {
    let mut common: Vec<Dim> = Vec::new();
    let mut rest_b = b.to_vec();
    for d in a {
        if let Some(i) = rest_b
            .iter()
            .position(|x| (x.stride, x.size) == (d.stride, d.size))
        {
            common.push(rest_b.remove(i));
        }
    }
    // `common` is in `a`'s order: ascending stride.
    let extent = |dims: &[Dim], outer: &[Dim]| -> Option<usize> {
        let mut left: Vec<Dim> = outer.to_vec();
        let mut max = 0usize;
        for d in dims {
            if let Some(i) = left
                .iter()
                .position(|x| (x.stride, x.size) == (d.stride, d.size))
            {
                left.remove(i);
                continue;
            }
            max = max.checked_add((d.size - 1).checked_mul(d.stride)?)?;
        }
        max.checked_add(es)
    };
    for k in 0..common.len() {
        let outer = &common[k..];
        let cell = outer[0].stride;
        let mut span = Some(cell);
        for d in outer {
            span = span
                .filter(|&s| d.stride >= s)
                .and_then(|s| span_of(d.size, d.stride, s));
        }
        if span.is_none() {
            continue;
        }
        let (Some(ea), Some(eb)) = (extent(a, outer), extent(b, outer)) else {
            continue;
        };
        let fits = ea <= cell && offset.checked_add(eb).is_some_and(|end| end <= cell);
        if fits && ea <= offset {
            return true;
        }
    }
    false
}

/// What [`check_planes`] found: each plane's base, and the memory they
/// touch as disjoint (address, bytes) regions.
#[derive(Debug)]
pub(crate) struct CheckedPlanes {
    /// Base address of each plane, index `layer * planes + plane`.
    pub bases: Vec<usize>,
    /// How each plane of a layer lays out its elements (index `plane`).
    pub strides: Vec<KvStrides>,
    /// The union of the planes' spans, split where they do not touch.
    pub regions: Vec<(usize, usize)>,
}

/// Checks one engine plane per `(layer, plane)` (order layer0.K,
/// layer0.V, layer1.K, …; MLA: one latent per layer) against `spec` and
/// `strides` (one per plane of a layer, or one shared): each non-null,
/// aligned to the element size, with room for every element its strides
/// reach, inside the address space; two planes whose spans overlap must be
/// proven to share no byte ([`planes_apart`]), or they are refused.
pub(crate) fn check_planes(
    spec: &KvCacheSpec,
    strides: &[KvStrides],
    planes: &[KvTensor],
) -> Result<CheckedPlanes, KvError> {
    let kinds = per_plane(spec, strides)?;
    let per_layer = spec.planes();
    let want = spec.layers * per_layer;
    if planes.len() != want {
        return Err(KvError::InvalidSpec(format!(
            "{} plane(s) given: pass {want}, one per layer{}, each its base address and \
             the bytes available from it",
            planes.len(),
            if per_layer == 2 {
                " and K/V, in the order layer0.K, layer0.V, layer1.K, ..."
            } else {
                " (the MLA latent)"
            }
        )));
    }
    let es = spec.dtype.size();
    // (start, end, plane index), by start.
    let mut spans = Vec::with_capacity(planes.len());
    for (i, t) in planes.iter().enumerate() {
        let name = plane_name(spec, i);
        let (st, span) = kinds[i % per_layer];
        if t.addr == 0 {
            return Err(KvError::InvalidSpec(format!(
                "plane {name} has a null address"
            )));
        }
        if t.addr % es as u64 != 0 {
            return Err(KvError::InvalidSpec(format!(
                "plane {name} at {:#x} is not aligned to its {es}-byte {} elements",
                t.addr, spec.dtype
            )));
        }
        if t.bytes < span {
            return Err(KvError::InvalidSpec(format!(
                "plane {name} has {} bytes from its base but its strides reach {span} \
                 ((num_blocks - 1) × block_stride + (block_size - 1) × token_stride + \
                 (num_heads - 1) × head_stride + (head_size - 1) × elem_stride + {es} = \
                 {} × {} + {} × {} + {} × {} + {} × {} + {es}); check num_blocks, block_size, \
                 the strides and the bytes given",
                t.bytes,
                spec.num_blocks - 1,
                st.block_stride,
                spec.block_size - 1,
                st.token_stride,
                st.num_heads - 1,
                st.head_stride,
                st.head_size - 1,
                st.elem_stride,
            )));
        }
        let end = t
            .addr
            .checked_add(span as u64)
            .filter(|e| *e <= usize::MAX as u64);
        let Some(end) = end else {
            return Err(KvError::InvalidSpec(format!(
                "plane {name} at {:#x} + {span} bytes overflows the address space",
                t.addr
            )));
        };
        spans.push((t.addr as usize, end as usize, i));
    }
    spans.sort_unstable();
    let dims: Vec<Vec<Dim>> = kinds.iter().map(|(st, _)| st.dims(spec)).collect();
    // Disjointness is pairwise: every pair of planes whose spans overlap
    // must be proven apart.
    for (n, &(start, end, i)) in spans.iter().enumerate() {
        for &(other, other_end, j) in spans[n + 1..].iter().take_while(|s| s.0 < end) {
            let (a, b) = (&dims[i % per_layer], &dims[j % per_layer]);
            if !planes_apart(a, b, other - start, es) {
                return Err(KvError::PlanesOverlap {
                    first: plane_name(spec, i.min(j)),
                    second: plane_name(spec, i.max(j)),
                    detail: format!(
                        "their spans [{start:#x}, {end:#x}) and [{other:#x}, {other_end:#x}) \
                         overlap and their strides do not prove their elements apart (planes \
                         sharing memory must keep to disjoint parts of a cell that strides \
                         common to both repeat); give each plane its own memory, or bases and \
                         strides that interleave them without sharing a byte (vLLM's CPU \
                         layout: V's base block_size × head_size × element size after K's, K \
                         with token_stride = element size and elem_stride = block_size × \
                         element size, V with token_stride = head_size × element size and \
                         elem_stride = element size; KvStrides::vllm_cpu in Rust)"
                    ),
                });
            }
        }
    }
    // The regions: unions of overlapping spans.
    let mut regions: Vec<(usize, usize)> = Vec::new();
    let mut open: Option<(usize, usize)> = None;
    for &(start, end, _) in &spans {
        open = match open {
            Some((s, e)) if start < e => Some((s, e.max(end))),
            Some((s, e)) => {
                regions.push((s, e - s));
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    if let Some((s, e)) = open {
        regions.push((s, e - s));
    }
    Ok(CheckedPlanes {
        bases: planes.iter().map(|t| t.addr as usize).collect(),
        strides: kinds.into_iter().map(|(st, _)| st).collect(),
        regions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Dtype, MemFormat};

    fn spec() -> KvCacheSpec {
        KvCacheSpec {
            fmt: MemFormat::Kv2Ltd,
            layers: 2,
            num_blocks: 3,
            block_size: 4,
            hidden: 6,
            dtype: Dtype::Float16,
        }
    }

    fn planes(bases: &[u64], bytes: usize) -> Vec<KvTensor> {
        bases.iter().map(|&addr| KvTensor { addr, bytes }).collect()
    }

    /// Every byte offset (from its base) each element of a plane touches,
    /// by brute force from the definition.
    fn touched(s: &KvCacheSpec, st: &KvStrides) -> Vec<usize> {
        let mut out = Vec::new();
        for b in 0..s.num_blocks {
            for t in 0..s.block_size {
                for h in 0..st.num_heads {
                    for e in 0..st.head_size {
                        let at = b * st.block_stride
                            + t * st.token_stride
                            + h * st.head_stride
                            + e * st.elem_stride;
                        out.extend(at..at + s.dtype.size());
                    }
                }
            }
        }
        out
    }

    #[test]
    fn the_vllm_cpu_layout_has_k_transposed_and_v_token_major_in_each_block_and_head_cell() {
        let s = spec();
        // 3 heads of 2 elements, blocks of 4 tokens, 2-byte elements: a
        // (block, head) cell is 2 × 4 × 2 × 2 = 32 bytes, K's 16 then V's 16.
        let [k, v] = KvStrides::vllm_cpu(&s, 3).unwrap();
        let st = |x: &KvStrides| {
            (
                x.head_size,
                x.block_stride,
                x.token_stride,
                x.head_stride,
                x.elem_stride,
            )
        };
        assert_eq!(st(&k), (2, 96, 2, 32, 8));
        assert_eq!(st(&v), (2, 96, 4, 32, 2));
        let layer = 3 * 3 * 32;
        let span = k.check(&s).unwrap();
        // K's last element: block 2, head 2, element 1, token 3.
        assert_eq!(span, 2 * 96 + 2 * 32 + 8 + 3 * 2 + 2);
        assert_eq!(
            v.check(&s).unwrap() + 16,
            layer,
            "V's last element ends the tensor"
        );
        // Element (b, t, h, e) exactly where the kernel puts it: K at cell
        // offset e·bs + t, V at bs·hs + t·hs + e (in elements).
        let (bs, hs) = (4, 2);
        for (b, t, h, e) in [(0, 0, 0, 0), (1, 3, 2, 1), (2, 1, 0, 1)] {
            let cell = (b * 3 + h) * 2 * bs * hs;
            let k_at =
                b * k.block_stride + t * k.token_stride + h * k.head_stride + e * k.elem_stride;
            assert_eq!(k_at, (cell + e * bs + t) * 2);
            let v_at =
                b * v.block_stride + t * v.token_stride + h * v.head_stride + e * v.elem_stride;
            assert_eq!(v_at + bs * hs * 2, (cell + bs * hs + t * hs + e) * 2);
        }
        let tensors = planes(&[0x1000, 0x2000], layer);
        let p = KvStrides::vllm_cpu_planes(&s, 3, &tensors).unwrap();
        assert_eq!(p[1].addr, 0x1000 + 16);
        assert_eq!(p[1].bytes, layer - 16);
        let c = check_planes(&s, &[k, v], &p).unwrap();
        assert_eq!(c.bases, vec![0x1000, 0x1010, 0x2000, 0x2010]);
        assert_eq!(c.strides, vec![k, v]);
        // K and V of a layer share its tensor: one region per layer, all of it.
        assert_eq!(c.regions, vec![(0x1000, layer), (0x2000, layer)]);
        // And truly apart, and together every byte of the tensor.
        let mut all: Vec<usize> = touched(&s, &k);
        all.extend(touched(&s, &v).into_iter().map(|o| o + 16));
        all.sort_unstable();
        assert_eq!(all, (0..layer).collect::<Vec<_>>());
        let e = KvStrides::vllm_cpu(
            &KvCacheSpec {
                fmt: MemFormat::Mla,
                ..s
            },
            1,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("an MLA cache has one plane per layer"), "{e}");
        let e = KvStrides::vllm_cpu_planes(&s, 3, &tensors[..1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 tensor(s) given for 2 layers"), "{e}");
    }

    #[test]
    fn block_size_equal_to_head_size_still_proves_k_and_v_apart() {
        // K's token dimension and V's element dimension then look alike
        // (stride es, size 4): the proof matches dimensions by stride and
        // size, not name, and still finds the (block, head) cell.
        let s = KvCacheSpec {
            hidden: 8,
            ..spec()
        };
        let [k, v] = KvStrides::vllm_cpu(&s, 2).unwrap();
        assert_eq!(
            (k.token_stride, v.elem_stride, k.elem_stride, v.token_stride),
            (2, 2, 8, 8)
        );
        let layer = 3 * 2 * 2 * 4 * 4 * 2;
        let p = KvStrides::vllm_cpu_planes(&s, 2, &planes(&[0x1000, 0x2000], layer)).unwrap();
        assert!(check_planes(&s, &[k, v], &p).is_ok());
        // V shifted by one element into K's region: refused.
        let mut shifted = p.clone();
        shifted[1].addr -= 2;
        shifted[1].bytes += 2;
        let e = check_planes(&s, &[k, v], &shifted).unwrap_err().to_string();
        assert!(
            e.contains("planes 0 (layer 0 K) and 1 (layer 0 V) overlap"),
            "{e}"
        );
    }

    #[test]
    fn planes_that_would_share_a_byte_are_refused() {
        let s = spec();
        let kv = KvStrides::vllm_cpu(&s, 3).unwrap();
        let layer = 288;
        // V one token after K: K's token 1 is V's token 0.
        let p = planes(&[0x1000, 0x1002, 0x2000, 0x2010], layer);
        let e = check_planes(&s, &kv, &p).unwrap_err().to_string();
        assert!(
            e.contains("planes 0 (layer 0 K) and 1 (layer 0 V) overlap")
                && e.contains("[0x1002, ")
                && e.contains("give each plane its own memory"),
            "{e}"
        );
        // V's region first in each cell, K's second: as apart.
        let p = planes(&[0x1010, 0x1000, 0x2010, 0x2000], layer - 16);
        assert!(check_planes(&s, &kv, &p).is_ok());
        // Both with K's strides, 8 bytes apart: element 1 of K's token 0
        // is element 0 of V's.
        let p = planes(&[0x1000, 0x1008, 0x2000, 0x2010], layer - 16);
        let e = check_planes(&s, &[kv[0]], &p).unwrap_err().to_string();
        assert!(
            e.contains("planes 0 (layer 0 K) and 1 (layer 0 V) overlap"),
            "{e}"
        );
        // Contiguous planes that overlap: no cell proves them apart.
        let c = KvStrides::contiguous(&s);
        let pb = s.plane_bytes();
        let p = planes(&[0x1000, 0x1000 + pb as u64 - 2, 0x3000, 0x4000], pb);
        let e = check_planes(&s, &[c], &p).unwrap_err().to_string();
        assert!(e.contains("overlap"), "{e}");
        // Adjacent contiguous planes are fine, each its own region.
        let p = planes(&[0x1000, 0x1000 + pb as u64, 0x3000, 0x4000], pb);
        let ok = check_planes(&s, &[c], &p).unwrap();
        assert_eq!(ok.regions.len(), 4);
        // The stacked [2, num_blocks, ...] of GPU backends: V after all of K.
        let layer = 2 * pb;
        let p = KvStrides::stacked_planes(&s, &planes(&[0x10000, 0x10000 + layer as u64], layer))
            .unwrap();
        assert_eq!(p[1].addr, 0x10000 + pb as u64);
        assert!(check_planes(&s, &[c, c], &p).is_ok());
    }

    #[test]
    fn interleaved_tokens_of_k_and_v_are_proven_apart() {
        // [num_blocks, block_size, 2, hidden]: K and V alternate by token;
        // the common token and block dimensions make a cell of 2 tokens.
        let s = spec();
        let tb = s.token_bytes();
        let st = KvStrides {
            token_stride: 2 * tb,
            block_stride: 2 * s.block_size * tb,
            ..KvStrides::contiguous(&s)
        };
        let layer = 2 * s.plane_bytes();
        let p = planes(
            &[0x1000, 0x1000 + tb as u64, 0x2000, 0x2000 + tb as u64],
            layer - tb,
        );
        let c = check_planes(&s, &[st], &p).unwrap();
        assert_eq!(c.regions, vec![(0x1000, layer), (0x2000, layer)]);
    }

    #[test]
    fn bad_strides_name_the_problem_and_the_fix() {
        let s = spec();
        let [good, v] = KvStrides::vllm_cpu(&s, 3).unwrap();
        let cases = [
            (
                KvStrides {
                    num_heads: 2,
                    ..good
                },
                "num_heads 2 × head_size 2 is not the cache's hidden size 6",
            ),
            (
                KvStrides {
                    token_stride: 3,
                    ..good
                },
                "token_stride 3 is not a multiple of the 2-byte float16 element",
            ),
            (
                KvStrides {
                    token_stride: 0,
                    ..good
                },
                "token_stride is 0 but block_size is 4",
            ),
            (
                KvStrides {
                    elem_stride: 0,
                    ..good
                },
                "elem_stride is 0 but head_size is 2",
            ),
            (
                KvStrides {
                    head_stride: 2,
                    ..v
                },
                "head_stride 2 is smaller than one head (2 elements × 2 bytes = 4)",
            ),
            (
                // K's tokens 2 bytes apart and its elements 4: token 2 of
                // element 0 is token 0 of element 1.
                KvStrides {
                    elem_stride: 4,
                    ..good
                },
                "elem_stride 4 is smaller than the 8 bytes spanned by the dimensions of \
                 smaller stride (one element, token_stride)",
            ),
            (
                // Elements and tokens both 8 bytes apart.
                KvStrides {
                    token_stride: 8,
                    ..good
                },
                "token_stride 8 is smaller than the 10 bytes spanned by the dimensions of \
                 smaller stride (one element, elem_stride)",
            ),
            (
                KvStrides {
                    block_stride: 40,
                    ..good
                },
                "block_stride 40 is smaller than the 80 bytes",
            ),
            (
                KvStrides {
                    block_stride: usize::MAX - 1,
                    ..good
                },
                "overflows",
            ),
        ];
        for (st, want) in cases {
            let e = st.check(&s).unwrap_err().to_string();
            assert!(e.contains(want), "{e}\nwant: {want}");
        }
        // Per-plane strides name the plane.
        let e = per_plane(
            &s,
            &[
                good,
                KvStrides {
                    elem_stride: 3,
                    ..v
                },
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("V plane: elem_stride 3 is not a multiple"),
            "{e}"
        );
        let e = per_plane(&s, &[good, v, v]).unwrap_err().to_string();
        assert!(
            e.contains("3 strides given: pass 2 (K's, then V's) or 1 shared by K and V"),
            "{e}"
        );
        // A plane too small for its strides.
        let p = planes(&[0x1000, 0x1010, 0x2000, 0x2010], 100);
        let e = check_planes(&s, &[good, v], &p).unwrap_err().to_string();
        assert!(
            e.contains(
                "plane 0 (layer 0 K) has 100 bytes from its base but its strides reach 272 \
                 ((num_blocks - 1) × block_stride + (block_size - 1) × token_stride + \
                 (num_heads - 1) × head_stride + (head_size - 1) × elem_stride + 2 = \
                 2 × 96 + 3 × 2 + 2 × 32 + 1 × 8 + 2)"
            ),
            "{e}"
        );
        let e = check_planes(&s, &[good, v], &p[..3])
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 plane(s) given: pass 4"), "{e}");
    }

    #[test]
    fn logical_ranges_map_to_runs_of_memory() {
        let s = spec();
        let [k, v] = KvStrides::vllm_cpu(&s, 3).unwrap();
        let mut got = Vec::new();
        // Slot 5 (block 1, token 1), all 12 bytes. V: three heads of 4
        // bytes, each at cell (1 × 3 + h) × 32, row 1 (4 bytes in).
        v.for_each_span(&s, 5 * 12, 12, |o, at, n| got.push((o, at, n)));
        assert_eq!(
            got,
            vec![(96 + 4, 0, 4), (96 + 32 + 4, 4, 4), (96 + 64 + 4, 8, 4)]
        );
        // K: six elements of 2 bytes, element e of token 1 at e × 8 + 2.
        got.clear();
        k.for_each_span(&s, 5 * 12, 12, |o, at, n| got.push((o, at, n)));
        assert_eq!(
            got,
            vec![
                (96 + 2, 0, 2),
                (96 + 8 + 2, 2, 2),
                (96 + 32 + 2, 4, 2),
                (96 + 32 + 8 + 2, 6, 2),
                (96 + 64 + 2, 8, 2),
                (96 + 64 + 8 + 2, 10, 2),
            ]
        );
        // A range starting and ending inside elements: byte 3 of slot 5 to
        // byte 2 of slot 6 (head 0 element 0's second byte).
        got.clear();
        k.for_each_span(&s, 5 * 12 + 3, 12, |o, at, n| got.push((o, at, n)));
        assert_eq!(got[0], (96 + 8 + 2 + 1, 0, 1));
        assert_eq!(got[4], (96 + 64 + 8 + 2, 7, 2));
        assert_eq!(got[5], (96 + 4, 9, 2), "slot 6: token 2, element 0");
        assert_eq!(got[6], (96 + 8 + 4, 11, 1));
        assert_eq!(got.iter().map(|g| g.2).sum::<usize>(), 12);
        // Contiguous strides: one run for a whole plane.
        let c = KvStrides::contiguous(&s);
        got.clear();
        c.for_each_span(&s, 0, s.plane_bytes(), |o, at, n| got.push((o, at, n)));
        assert_eq!(got, vec![(0, 0, s.plane_bytes())]);
        // Padded tokens (16-byte token stride for 12 bytes): one run per token.
        let padded = KvStrides {
            token_stride: 16,
            block_stride: 64,
            ..c
        };
        padded.check(&s).unwrap();
        got.clear();
        padded.for_each_span(&s, 10, 20, |o, at, n| got.push((o, at, n)));
        assert_eq!(got, vec![(10, 0, 2), (16, 2, 12), (32, 14, 6)]);
        // Every byte of every plane, mapped, is where the definition puts it.
        for st in [k, v, padded] {
            let mut mapped = Vec::new();
            st.for_each_span(&s, 0, s.plane_bytes(), |o, at, n| {
                assert_eq!(at, mapped.len());
                mapped.extend(o..o + n);
            });
            let mut want = vec![0; s.plane_bytes()];
            for slot in 0..s.slots() {
                for h in 0..st.num_heads {
                    for e in 0..st.head_size {
                        let at = (slot / 4) * st.block_stride
                            + (slot % 4) * st.token_stride
                            + h * st.head_stride
                            + e * st.elem_stride;
                        for b in 0..2 {
                            want[slot * 12 + (h * st.head_size + e) * 2 + b] = at + b;
                        }
                    }
                }
            }
            assert_eq!(mapped, want, "{st:?}");
        }
    }
}
