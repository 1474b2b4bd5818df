"""How an attention backend lays out its KV cache, as strides.

vLLM hands a connector one cache tensor per layer (vLLM-Ascend: a ``(K, V)``
pair per layer). Whatever the backend, each layer's cache is described
here by its planes (K and V, or the MLA latent) and four numbers shared by
the same plane of every layer: where block ``b``, token ``t`` (within the
block), head ``h`` and element ``e`` of a plane live, ``base +
b*block_stride + t*token_stride + h*head_stride + e*elem_stride``. The library plans its copies from that,
so a prefill with one layout feeds a decode with another: pages and the
wire keep one canonical chunk layout.

Layouts understood:

* vLLM-Ascend: ``(K, V)`` per layer, each ``[num_blocks, block_size, heads, head_size]``;
* vLLM's CPU backend (``CPU_ATTN``, its ``vec``/``vec16`` kernels): one
  ``[num_blocks, heads, block_size, 2*head_size]`` tensor per layer whose
  every (block, head) cell holds K transposed (element ``e`` of token ``t`` at
  ``e*block_size + t``) and then V token-major (``block_size*head_size +
  t*head_size + e``) -- measured against the kernel that writes it, not read
  off the shape. Its ``amx`` kernel packs tokens in tiles and is refused;
* stacked K/V of the GPU backends: ``[2, num_blocks, block_size, heads, head_size]``
  (or any stride permutation of it: the strides are read, not assumed);
* MLA: ``[num_blocks, block_size, latent]`` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

#: (block, token, head, element) strides of one plane, in bytes.
Strides = Tuple[int, int, int, int]


class LayoutError(ValueError):
    """A KV cache the connector cannot describe."""


@dataclass(frozen=True)
class CacheLayout:
    """A whole cache described by strides (bytes)."""

    #: ``(address, bytes available from it)`` of each plane, in the order
    #: layer0.K, layer0.V, layer1.K, ... (MLA: one latent per layer).
    planes: Tuple[Tuple[int, int], ...]
    #: The strides of each plane of a layer (K, V; MLA: the latent), the
    #: same for every layer.
    strides: Tuple[Strides, ...]
    fmt: str
    dtype: str
    layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    device: int
    #: The engine's tensors the addresses point into (keep them alive).
    keep: Tuple[Any, ...]

    @property
    def hidden(self) -> int:
        """Elements per token per plane."""
        return self.num_heads * self.head_size


@dataclass(frozen=True)
class _LayerPlanes:
    bases: Tuple[int, ...]
    extents: Tuple[int, ...]
    strides: Tuple[Strides, ...]
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int

    def geometry(self) -> Tuple[Any, ...]:
        return (self.strides, self.num_blocks, self.block_size, self.num_heads, self.head_size)


def _dtype_name(t: Any) -> str:
    name = str(t.dtype)
    return name[len("torch.") :] if name.startswith("torch.") else name


def _end(t: Any) -> int:
    """The address just past ``t``'s last element."""
    es = int(t.element_size())
    last = sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride()) if int(n) > 0)
    return int(t.data_ptr()) + (last + 1) * es


def _view_planes(t: Any, plane_dim: Optional[int], dims: Tuple[int, int, int, int]) -> _LayerPlanes:
    """Planes of a tensor whose dims ``dims`` are (block, token, head,
    element) and ``plane_dim`` (if any) K/V, strides read off the tensor."""
    es = int(t.element_size())
    stride = [int(s) * es for s in t.stride()]
    shape = [int(n) for n in t.shape]
    b, tok, h, e = dims
    n_planes = 1 if plane_dim is None else shape[plane_dim]
    base = int(t.data_ptr())
    bases = tuple(base + (0 if plane_dim is None else p * stride[plane_dim]) for p in range(n_planes))
    one: Strides = (stride[b], stride[tok], stride[h], stride[e])
    end = _end(t)
    return _LayerPlanes(
        bases=bases,
        extents=tuple(end - pb for pb in bases),
        strides=(one,) * n_planes,
        num_blocks=shape[b],
        block_size=shape[tok],
        num_heads=shape[h],
        head_size=shape[e],
    )


def _cpu_attn(t: Any, num_heads: int, head_size: int, isa: Optional[str]) -> _LayerPlanes:
    shape = tuple(int(n) for n in t.shape)
    if len(shape) != 4 or shape[1] != num_heads or shape[3] != 2 * head_size:
        raise LayoutError(
            f"CPU_ATTN cache of shape {shape}: expected [num_blocks, {num_heads}, block_size, "
            f"{2 * head_size}] (num_blocks, KV heads, block size, 2 x head size)"
        )
    if isa not in (None, "vec", "vec16"):
        raise LayoutError(
            f"vLLM's CPU attention runs its {isa!r} kernel, whose KV cache interior ascend-pd "
            "does not know (it knows 'vec' and 'vec16'): run with float16/float32, or a block "
            "size that selects 'vec'"
        )
    if not t.is_contiguous():
        raise LayoutError(f"CPU_ATTN cache of shape {shape} is not contiguous")
    es = int(t.element_size())
    nb, h, bs, _ = shape
    cell = 2 * bs * head_size * es  # one (block, head): K then V
    block = h * cell
    base = int(t.data_ptr())
    end = _end(t)
    k: Strides = (block, es, cell, bs * es)  # K transposed: [head_size][block_size]
    v: Strides = (block, head_size * es, cell, es)  # V token-major: [block_size][head_size]
    v_base = base + bs * head_size * es
    return _LayerPlanes(
        bases=(base, v_base),
        extents=(end - base, end - v_base),
        strides=(k, v),
        num_blocks=nb,
        block_size=bs,
        num_heads=h,
        head_size=head_size,
    )


def layer_planes(
    cache: Any, backend: str, num_heads: int, head_size: int, use_mla: bool, isa: Optional[str] = None
) -> _LayerPlanes:
    """Describes one layer's cache as the backend ``backend`` lays it out."""
    if isinstance(cache, (tuple, list)):
        if len(cache) == 2 and not use_mla:
            # vLLM-Ascend: (K, V), each [num_blocks, block_size, heads, head].
            k, v = (_as_4d(x, num_heads, head_size) for x in cache)
            kp, vp = _view_planes(k, None, (0, 1, 2, 3)), _view_planes(v, None, (0, 1, 2, 3))
            if kp.geometry() != vp.geometry():
                raise LayoutError(
                    f"K {tuple(k.shape)}/{tuple(k.stride())} and V {tuple(v.shape)}/{tuple(v.stride())} "
                    "differ in shape or strides: pass one (K, V) pair of equal tensors per layer"
                )
            return _LayerPlanes(
                bases=kp.bases + vp.bases,
                extents=kp.extents + vp.extents,
                strides=kp.strides + vp.strides,
                num_blocks=kp.num_blocks,
                block_size=kp.block_size,
                num_heads=kp.num_heads,
                head_size=kp.head_size,
            )
        if len(cache) == 1:
            cache = cache[0]
        else:
            raise LayoutError(f"a layer's cache is a {len(cache)}-tuple: pass (K, V) or one tensor")
    t = cache
    shape = tuple(int(n) for n in t.shape)
    if use_mla:
        # [num_blocks, block_size, latent] (a head dim of 1 is allowed).
        if len(shape) == 4 and shape[2] == 1:
            return _view_planes(t, None, (0, 1, 2, 3))
        if len(shape) != 3:
            raise LayoutError(f"an MLA cache of shape {shape}: expected [num_blocks, block_size, latent]")
        return _view_planes(t.unsqueeze(2), None, (0, 1, 2, 3))
    if backend == "CPU_ATTN":
        return _cpu_attn(t, num_heads, head_size, isa)
    if len(shape) == 5 and shape[0] == 2:
        # Stacked [2, num_blocks, block_size, heads, head] (strides read as they are).
        return _view_planes(t, 0, (1, 2, 3, 4))
    if len(shape) == 5 and shape[1] == 2:
        # [num_blocks, 2, block_size, heads, head].
        return _view_planes(t, 1, (0, 2, 3, 4))
    raise LayoutError(
        f"the {backend} attention backend's KV cache of shape {shape} (strides {tuple(t.stride())}) "
        "is not a layout ascend-pd knows: supported are vLLM-Ascend's (K, V) pairs, CPU_ATTN, "
        "stacked [2, num_blocks, block_size, heads, head] and MLA"
    )


def _as_4d(t: Any, num_heads: int, head_size: int) -> Any:
    shape = tuple(int(n) for n in t.shape)
    if len(shape) == 4:
        return t
    if len(shape) == 3 and shape[2] == num_heads * head_size:
        return t.view(shape[0], shape[1], num_heads, head_size)
    raise LayoutError(
        f"a K or V tensor of shape {shape}: expected [num_blocks, block_size, {num_heads}, {head_size}]"
    )


def describe(
    caches: Sequence[Any],
    backend: str,
    num_heads: int,
    head_size: int,
    use_mla: bool,
    isa: Optional[str] = None,
) -> CacheLayout:
    """Describes a model's per-layer caches (in layer order) by strides."""
    if not caches:
        raise LayoutError("no KV cache tensors were registered")
    layers = [layer_planes(c, backend, num_heads, head_size, use_mla, isa) for c in caches]
    first = layers[0]
    for i, lp in enumerate(layers[1:], start=1):
        if lp.geometry() != first.geometry():
            raise LayoutError(f"layer {i}'s KV cache differs in shape or strides from layer 0's")
    planes: List[Tuple[int, int]] = []
    for lp in layers:
        planes.extend(zip(lp.bases, lp.extents))
    sample = caches[0][0] if isinstance(caches[0], (tuple, list)) else caches[0]
    dev = getattr(sample, "device", None)
    device = -1 if dev is None or getattr(dev, "type", "cpu") == "cpu" else int(getattr(dev, "index", 0) or 0)
    return CacheLayout(
        planes=tuple(planes),
        strides=first.strides,
        fmt="mla" if use_mla else "kv",
        dtype=_dtype_name(sample),
        layers=len(layers),
        num_blocks=first.num_blocks,
        block_size=first.block_size,
        num_heads=first.num_heads,
        head_size=first.head_size,
        device=device,
        keep=tuple(caches),
    )


def check_geometry(layout: CacheLayout, layers: int, num_heads: int, head_size: int, block_size: int,
                   dtype: str) -> None:
    """Raises :class:`LayoutError` naming every way the KV tensors vLLM
    registered differ from what its model and cache config say (layers, KV
    heads per rank, head size, block size, dtype): the connector moves what
    the config describes, so a disagreement would move the wrong bytes."""
    seen = (("layers", layout.layers, layers), ("KV heads per rank", layout.num_heads, num_heads),
            ("head size", layout.head_size, head_size), ("block size", layout.block_size, block_size),
            ("dtype", layout.dtype, dtype))
    problems = [f"{what}: the tensors have {got}, the config {want}" for what, got, want in seen if got != want]
    if problems:
        raise LayoutError(
            "vLLM's KV cache tensors do not match its model and cache config (" + "; ".join(problems)
            + "): AscendPDConnector does not know this attention backend's layout for this model"
        )
