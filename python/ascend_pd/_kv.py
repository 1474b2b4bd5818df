"""Wrapping an engine's KV cache tensors."""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

from . import _lib
from ._errors import InvalidArgument, check

#: A dtype given by name ("float16", "bfloat16", "float32", "int8", "uint8")
#: or by its ``APD_DTYPE_*`` code.
DTypeLike = Union[str, int]

_DTYPE_CODES: Dict[str, int] = {
    "bfloat16": _lib.DTYPE_BFLOAT16,
    "float16": _lib.DTYPE_FLOAT16,
    "float32": _lib.DTYPE_FLOAT32,
    "int8": _lib.DTYPE_INT8,
    "uint8": _lib.DTYPE_UINT8,
}
_DTYPE_ALIASES: Dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}
_DTYPE_NAMES: Dict[int, str] = {code: name for name, code in _DTYPE_CODES.items()}
# numpy's __array_interface__ typestr (without byte order) -> dtype name.
_TYPESTR: Dict[str, str] = {"f2": "float16", "f4": "float32", "i1": "int8", "u1": "uint8"}

_FORMATS: Dict[str, int] = {"kv": _lib.FMT_KV_2LTD, "mla": _lib.FMT_MLA}
_FORMAT_NAMES: Dict[int, str] = {code: name for name, code in _FORMATS.items()}


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(_lib.ERR_INVALID_ARGUMENT, message)


def dtype_code(dtype: DTypeLike) -> int:
    """The ``APD_DTYPE_*`` code of a dtype name (or code).

    Accepts "float16" (also "fp16", "half"), "bfloat16" ("bf16"), "float32"
    ("fp32", "float"), "int8", "uint8", a ``torch.dtype`` or numpy dtype of
    one of these, or the code itself.
    """
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype in _DTYPE_NAMES:
            return dtype
        raise _bad(f"dtype {dtype} is not an APD_DTYPE_* code (0 to 4)")
    name = str(dtype).lower()
    if name.startswith("torch."):
        name = name[len("torch.") :]
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPE_CODES:
        raise _bad(
            f"dtype {dtype!r} is not supported: pass one of "
            f"{', '.join(sorted(_DTYPE_CODES))}"
        )
    return _DTYPE_CODES[name]


def _dtype_name_of(obj: Any) -> Optional[str]:
    """The supported dtype name of a numpy array or torch tensor, if any."""
    dt = getattr(obj, "dtype", None)
    if dt is None:
        return None
    name = str(dt).lower()
    if name.startswith("torch."):
        name = name[len("torch.") :]
    name = _DTYPE_ALIASES.get(name, name)
    return name if name in _DTYPE_CODES else None


def _c_contiguous(shape: Sequence[int], strides: Optional[Sequence[int]], itemsize: int) -> bool:
    if strides is None:
        return True
    expect = itemsize
    for n, s in zip(reversed(list(shape)), reversed(list(strides))):
        if n == 0:
            return True
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


class _Memory:
    """One tensor's address, size, inferred dtype and what keeps it alive."""

    __slots__ = ("addr", "nbytes", "dtype", "keep")

    def __init__(self, addr: int, nbytes: int, dtype: Optional[str], keep: Any) -> None:
        self.addr = addr
        self.nbytes = nbytes
        self.dtype = dtype
        self.keep = keep


def _device_of(obj: Any, index: int) -> Optional[int]:
    """Where a tensor's memory is: -1 (host), an NPU id, or None when the
    object does not say (an ``(address, nbytes)`` tuple)."""
    if isinstance(obj, tuple):
        return None
    dev = getattr(obj, "device", None)
    if dev is None:
        # numpy arrays and buffers are host memory.
        return _lib.DEVICE_CPU
    dev_type = str(getattr(dev, "type", dev)).split(":")[0].lower()
    if dev_type == "cpu":
        return _lib.DEVICE_CPU
    if dev_type == "npu":
        idx = getattr(dev, "index", None)
        return int(idx) if idx is not None else 0
    raise _bad(
        f"tensors[{index}] is on device {dev!r}: ascend-pd reads and writes host memory "
        "and Ascend NPUs (torch_npu tensors) only"
    )


def _device_for(tensors: Sequence[Any], device: Optional[int]) -> int:
    """The cache's device: the one the tensors are on, which ``device``
    (when given) must match; host memory when nothing says otherwise."""
    seen: Dict[int, int] = {}
    for i, t in enumerate(tensors):
        d = _device_of(t, i)
        if d is not None:
            seen.setdefault(d, i)
    if len(seen) > 1:
        (a, i), (b, j) = sorted(seen.items(), key=lambda kv: kv[1])[:2]
        raise _bad(
            f"tensors[{i}] is on {_device_name(a)} but tensors[{j}] on {_device_name(b)}: "
            "every tensor of a KV cache must be on one device"
        )
    if device is None:
        return next(iter(seen), _lib.DEVICE_CPU)
    device = int(device)
    for d, i in seen.items():
        if d != device:
            raise _bad(
                f"device={device} ({_device_name(device)}) but tensors[{i}] is on "
                f"{_device_name(d)}: leave device= out to take the tensors' device, or pass "
                "tensors on that device"
            )
    return device


def _device_name(d: int) -> str:
    return "host memory" if d == _lib.DEVICE_CPU else f"NPU {d}"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _memory_of(obj: Any, index: int) -> _Memory:
    what = f"tensors[{index}]"
    # (d) (address, nbytes)
    if isinstance(obj, tuple) and len(obj) == 2 and _is_int(obj[0]) and _is_int(obj[1]):
        addr, nbytes = obj
        if addr < 0 or nbytes < 0:
            raise _bad(f"{what} is ({addr}, {nbytes}): address and size must not be negative")
        return _Memory(addr, nbytes, None, obj)
    # (c) torch / torch_npu tensors
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr):
        is_contiguous = getattr(obj, "is_contiguous", None)
        if callable(is_contiguous) and not is_contiguous():
            raise _bad(f"{what} is not contiguous: pass tensor.contiguous() or the cache tensor itself")
        try:
            nbytes = int(obj.numel()) * int(obj.element_size())
        except AttributeError:
            raise TypeError(
                f"{what} has data_ptr() but no numel()/element_size(): pass a torch tensor, "
                "a numpy array, a writable buffer or an (address, nbytes) tuple"
            ) from None
        return _Memory(int(data_ptr()), nbytes, _dtype_name_of(obj), obj)
    # (a) numpy arrays and anything with __array_interface__
    ai = getattr(obj, "__array_interface__", None)
    if isinstance(ai, dict) and isinstance(ai.get("data"), tuple):
        addr, readonly = ai["data"]
        if readonly:
            raise _bad(f"{what} is read-only: the receiver writes into the cache; pass a writable array")
        typestr = str(ai.get("typestr", ""))
        try:
            itemsize = int(typestr[2:])
        except ValueError:
            raise _bad(f"{what} has an unknown element type {typestr!r}") from None
        shape = tuple(int(n) for n in ai.get("shape", ()))
        if not _c_contiguous(shape, ai.get("strides"), itemsize):
            raise _bad(f"{what} is not C-contiguous: pass numpy.ascontiguousarray(...) or the cache itself")
        count = 1
        for n in shape:
            count *= n
        dtype = _dtype_name_of(obj) or _TYPESTR.get(typestr[1:])
        return _Memory(int(addr or 0), count * itemsize, dtype, obj)
    # (b) the buffer protocol
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{what} is a {type(obj).__name__}: pass a numpy array, a torch tensor, a writable "
            "buffer (bytearray, memoryview, ...) or an (address, nbytes) tuple"
        ) from None
    with view:
        if view.readonly:
            raise _bad(f"{what} is a read-only buffer: the receiver writes into the cache; pass a writable one")
        if not view.c_contiguous:
            raise _bad(f"{what} is not a C-contiguous buffer")
        nbytes = view.nbytes
    # A ctypes array over the buffer: its address, and it holds the buffer
    # export (a bytearray cannot be resized under the library).
    arr = (ctypes.c_char * nbytes).from_buffer(obj)
    return _Memory(ctypes.addressof(arr), nbytes, None, (obj, arr))


def _plane_memory_of(obj: Any, index: int) -> _Memory:
    """A plane of a strided cache: its base address and the bytes available
    from it. A torch view need not be contiguous (a plane of vLLM's CPU
    layout is not): its bytes run to the end of its storage."""
    data_ptr = getattr(obj, "data_ptr", None)
    is_contiguous = getattr(obj, "is_contiguous", None)
    if callable(data_ptr) and callable(is_contiguous) and not is_contiguous():
        what = f"tensors[{index}]"
        storage = getattr(obj, "untyped_storage", None)
        if not callable(storage):
            raise _bad(
                f"{what} is a non-contiguous tensor without untyped_storage(): pass the "
                "plane as an (address, nbytes) tuple (its base and the bytes available from it)"
            )
        st = storage()
        addr = int(data_ptr())
        end = int(st.data_ptr()) + int(st.nbytes())
        if not int(st.data_ptr()) <= addr <= end:
            raise _bad(f"{what} starts outside its storage: pass an (address, nbytes) tuple")
        return _Memory(addr, end - addr, _dtype_name_of(obj), obj)
    ai = getattr(obj, "__array_interface__", None)
    if isinstance(ai, dict) and ai.get("strides") is not None and not callable(data_ptr):
        typestr = str(ai.get("typestr", ""))
        shape = tuple(int(n) for n in ai.get("shape", ()))
        itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 1
        if not _c_contiguous(shape, ai.get("strides"), itemsize):
            raise _bad(
                f"tensors[{index}] is a non-contiguous array, whose extent the library cannot "
                "see: pass the plane as an (address, nbytes) tuple (its base and the bytes "
                "available from it)"
            )
    return _memory_of(obj, index)


_ITEMSIZE: Dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "uint8": 1}


def _plane_strides(value: Any, what: str) -> Tuple[int, int, int, int]:
    """One plane's strides as ``(block, token, head, element)``; element 0
    stands for the element size."""
    if (
        isinstance(value, (str, bytes))
        or not isinstance(value, Sequence)
        or len(value) not in (3, 4)
        or not all(_is_int(s) for s in value)
    ):
        raise _bad(
            f"{what} is {value!r}: pass (block_stride, token_stride, head_stride) or "
            "(block_stride, token_stride, head_stride, elem_stride) in bytes"
        )
    if any(s < 0 for s in value):
        raise _bad(f"{what} {tuple(value)} must not be negative")
    return (int(value[0]), int(value[1]), int(value[2]), int(value[3]) if len(value) == 4 else 0)


def _strides_of(
    strides: Sequence[Any],
    num_heads: Optional[int],
    head_size: Optional[int],
    hidden: int,
    planes: int,
) -> Tuple[List[Tuple[int, int, int, int]], int, int]:
    """The strides of each plane of a layer given (one tuple shared by all,
    or one per plane), the KV heads and the elements of a head."""
    if isinstance(strides, (str, bytes)) or not isinstance(strides, Sequence) or len(strides) == 0:
        raise _bad(
            f"strides is {strides!r}: pass (block_stride, token_stride, head_stride[, "
            "elem_stride]) in bytes, or a list of one such tuple per plane of a layer"
        )
    if all(_is_int(s) for s in strides):
        per_plane = [_plane_strides(strides, "strides")]
    else:
        per_plane = [_plane_strides(p, f"strides[{i}]") for i, p in enumerate(strides)]
        if len(per_plane) not in (1, planes):
            which = "K's, then V's" if planes == 2 else "the MLA latent's"
            raise _bad(
                f"strides has {len(per_plane)} entries: pass one per plane of a layer "
                f"({planes}: {which}), or one shared by all"
            )
    if num_heads is None and head_size is None:
        raise _bad(
            "strides= needs num_heads= or head_size= (the KV heads of one plane, or the "
            "elements of one head; the other is hidden divided by it)"
        )
    if num_heads is None:
        assert head_size is not None
        if head_size <= 0 or hidden % head_size:
            raise _bad(f"head_size {head_size} does not divide hidden {hidden}")
        num_heads = hidden // head_size
    if head_size is None:
        if num_heads <= 0 or hidden % num_heads:
            raise _bad(f"num_heads {num_heads} does not divide hidden {hidden}")
        head_size = hidden // num_heads
    if num_heads < 0 or head_size < 0:
        raise _bad(f"num_heads {num_heads} and head_size {head_size} must not be negative")
    return per_plane, int(num_heads), int(head_size)


def _stream_address(stream: Any) -> Optional[int]:
    if stream is None:
        return None
    if _is_int(stream):
        return int(stream)
    if isinstance(stream, ctypes.c_void_p):
        return stream.value
    for attr in ("npu_stream", "stream_ptr"):
        value: Any = getattr(stream, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise TypeError(
        f"stream is a {type(stream).__name__}: pass the aclrtStream address as an int, "
        "a torch_npu stream (its .npu_stream is used) or None"
    )


def _format_code(fmt: Union[str, int]) -> int:
    if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt in _FORMAT_NAMES:
        return fmt
    code = _FORMATS.get(str(fmt).lower())
    if code is None:
        raise _bad(f"fmt {fmt!r} is not supported: pass \"kv\" (K and V planes) or \"mla\"")
    return code


class KVCache:
    """An engine's KV cache, wrapped for saves and loads.

    ``tensors`` is either one tensor holding the whole cache as
    ``[layers][planes][num_blocks * block_size][hidden]``, or one tensor per
    layer and plane, ``[num_blocks, block_size, hidden]`` each, in the order
    layer0.K, layer0.V, layer1.K, ... (MLA: one latent tensor per layer).
    Each item may be:

    * a numpy array or any object with ``__array_interface__``
      (C-contiguous and writable),
    * an object exposing the buffer protocol (writable, contiguous),
    * a torch / torch_npu tensor (``data_ptr()``, ``numel()``,
      ``element_size()``),
    * an ``(address, nbytes)`` tuple.

    The library does not own the memory: this object keeps references to
    the tensors for its whole lifetime (senders and receivers keep the
    cache alive while one of their requests uses it). Every tensor is
    checked against the geometry when wrapped.

    **Strided layouts.** With ``strides`` (bytes) and ``num_heads`` /
    ``head_size``, each plane's element (block b, token t, head h, element
    e) lives at ``base + b*block_stride + t*token_stride + h*head_stride +
    e*elem_stride``. ``strides`` is one tuple shared by every plane,
    ``(block_stride, token_stride, head_stride)`` (``elem_stride`` the
    itemsize: a head's elements contiguous) or ``(block_stride,
    token_stride, head_stride, elem_stride)``, or a list of one such tuple
    per plane of a layer (K's, then V's; MLA: the latent's), applied to
    every layer. ``tensors`` then holds one entry per layer and plane
    (layer0.K, layer0.V, layer1.K, ...; MLA: one per layer) giving that
    plane's base: an ``(address, nbytes)`` tuple (the bytes available from
    the base), or a tensor whose ``data_ptr()`` is the base (a
    non-contiguous torch view counts the bytes to the end of its storage).
    Planes may share a tensor: vLLM's CPU backend (its ``vec`` and
    ``vec16`` kernels) keeps per layer one ``[num_blocks, num_kv_heads,
    block_size, 2 * head_size]`` tensor in which each (block, head) holds
    K's ``block_size * head_size`` elements transposed (element e of token
    t at ``e * block_size + t``), then V's token-major (at ``t * head_size
    + e``). With ``es`` the itemsize, ``cell = 2 * block_size * head_size *
    es``: K at the tensor's base with strides ``(num_kv_heads * cell, es,
    cell, block_size * es)``, V ``block_size * head_size * es`` bytes later
    with ``(num_kv_heads * cell, head_size * es, cell, es)``. Layouts whose
    tokens are not one run (that one: every element of K is its own copy)
    work in host memory; on an NPU each token's elements must be
    contiguous. The wrap refuses strides under which two elements could
    share a byte or an element lies outside its plane's bytes.

    Args:
        tensors: the tensors (see above).
        fmt: ``"kv"`` (K and V planes) or ``"mla"`` (one latent plane per layer).
        dtype: the element type; inferred from numpy arrays and torch
            tensors when omitted.
        layers: transformer layers.
        num_blocks: blocks per tensor.
        block_size: tokens per block.
        hidden: elements per token (num_kv_heads * head_size, or the MLA latent size).
        device: -1 for host memory, or the NPU id of device memory;
            inferred from the tensors when omitted (torch tensors'
            ``device``; numpy arrays and buffers are host memory;
            ``(address, nbytes)`` tuples say nothing, so host unless given).
            A device that differs from a tensor's is refused, naming both.
        stream: optional ``aclrtStream`` of the engine (NPU caches only).
        strides: ``(block_stride, token_stride, head_stride[, elem_stride])``
            in bytes, or a list of one such tuple per plane of a layer, for
            a cache described by strides (see above); ``None``: the layouts
            listed first.
        num_heads: KV heads per plane (1 for MLA); with ``strides``.
        head_size: elements per head (the MLA latent size); with ``strides``.
            Either may be omitted: it is ``hidden`` divided by the other.

    Usable as a context manager (closes on exit).
    """

    def __init__(
        self,
        tensors: Sequence[Any],
        *,
        fmt: Union[str, int] = "kv",
        dtype: Optional[DTypeLike] = None,
        layers: int,
        num_blocks: int,
        block_size: int,
        hidden: int,
        device: Optional[int] = None,
        stream: Any = None,
        strides: Optional[Sequence[Any]] = None,
        num_heads: Optional[int] = None,
        head_size: Optional[int] = None,
    ) -> None:
        self._handle = _lib.ApdKvCache(0)
        self._closed = True  # until wrapped
        if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
            raise TypeError("tensors must be a list of tensors (see KVCache's documentation)")
        if strides is None and (num_heads is not None or head_size is not None):
            raise _bad("num_heads= and head_size= describe a strided cache: pass strides= too")
        fmt_code = _format_code(fmt)
        planes = 1 if fmt_code == _lib.FMT_MLA else 2
        parsed = (
            None
            if strides is None
            else _strides_of(strides, num_heads, head_size, int(hidden), planes)
        )
        memory_of = _memory_of if parsed is None else _plane_memory_of
        # Before any address is taken: host copies from device addresses
        # would crash the process.
        device = _device_for(tensors, device)
        memories = [memory_of(t, i) for i, t in enumerate(tensors)]
        if dtype is None:
            inferred = {m.dtype for m in memories}
            if None in inferred or not inferred:
                raise _bad(
                    "cannot infer the KV cache's dtype from these tensors: pass dtype= "
                    "(\"float16\", \"bfloat16\", \"float32\", \"int8\" or \"uint8\")"
                )
            if len(inferred) > 1:
                raise _bad(f"the tensors have different dtypes {sorted(str(d) for d in inferred)}: they must agree")
            dtype = inferred.pop()
        code = dtype_code(dtype)  # type: ignore[arg-type]
        array = (_lib.ApdKvTensor * len(memories))()
        for i, m in enumerate(memories):
            array[i].addr = m.addr
            array[i].bytes = m.nbytes
        desc = _lib.ApdKvCacheDesc(
            fmt=fmt_code,
            dtype=code,
            layers=int(layers),
            num_blocks=int(num_blocks),
            block_size=int(block_size),
            hidden=int(hidden),
            device=int(device),
            tensors=array,
            num_tensors=len(memories),
            stream=_stream_address(stream),
        )
        out = _lib.ApdKvCache()
        itemsize = _ITEMSIZE[_DTYPE_NAMES[code]]
        # Each plane's (block, token, head, elem) strides in bytes, or None.
        resolved: Optional[List[Tuple[int, int, int, int]]] = None
        if parsed is None:
            check(_lib.lib().apd_kv_cache_wrap(ctypes.byref(desc), ctypes.byref(out)))
        else:
            per_plane, heads, size = parsed
            c_strides = (_lib.ApdKvStrides * len(per_plane))(
                *(
                    _lib.ApdKvStrides(
                        num_heads=heads,
                        head_size=size,
                        block_stride=b,
                        token_stride=t,
                        head_stride=h,
                        elem_stride=e,
                    )
                    for b, t, h, e in per_plane
                )
            )
            check(
                _lib.lib().apd_kv_cache_wrap_strided(
                    ctypes.byref(desc), c_strides, len(per_plane), ctypes.byref(out)
                )
            )
            resolved = [
                (b, t, h, e or itemsize) for b, t, h, e in per_plane * (planes // len(per_plane))
            ]
        self._handle = out
        self._closed = False
        # The library does not own the memory: keep it alive as long as we are.
        self._keep: Tuple[Any, ...] = tuple(m.keep for m in memories)
        self._stream = stream
        self.fmt: str = _FORMAT_NAMES[fmt_code]
        self.dtype: str = _DTYPE_NAMES[code]
        self.layers: int = int(layers)
        self.num_blocks: int = int(num_blocks)
        self.block_size: int = int(block_size)
        self.hidden: int = int(hidden)
        self.device: int = int(device)
        #: ``(block_stride, token_stride, head_stride, elem_stride)`` in bytes
        #: of each plane of a layer (K, V; MLA: the latent), or None.
        self.strides: Optional[List[Tuple[int, int, int, int]]] = resolved
        self.num_heads: Optional[int] = None if parsed is None else parsed[1]
        self.head_size: Optional[int] = None if parsed is None else parsed[2]

    @classmethod
    def from_vllm(
        cls: Type["KVCache"],
        kv_caches: Union[Sequence[Any], Mapping[str, Any]],
        *,
        block_size: Optional[int] = None,
        fmt: Optional[str] = None,
        dtype: Optional[DTypeLike] = None,
        device: Optional[int] = None,
        stream: Any = None,
    ) -> "KVCache":
        """Wraps vLLM-Ascend's per-layer KV cache list.

        ``kv_caches`` holds one entry per layer (a list, or a dict whose
        values are in layer order): a ``(K, V)`` pair of tensors of shape
        ``[num_blocks, block_size, num_kv_heads, head_size]``, one tensor of
        shape ``[2, num_blocks, block_size, ...]`` (K and V stacked), or for
        MLA a single latent tensor ``[num_blocks, block_size, ...]`` (or a
        1-tuple). The geometry comes from the shapes: ``num_blocks`` is
        dimension 0, ``block_size`` dimension 1 unless given, ``hidden`` the
        rest of a block divided by ``block_size``. ``device`` is taken from
        torch tensors (``tensor.device``) unless given; numpy arrays are on
        the host.
        """
        layers_in = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
        if not layers_in:
            raise _bad("kv_caches is empty: pass one entry per layer")
        planes: List[Any] = []
        kinds = set()
        for i, layer in enumerate(layers_in):
            if isinstance(layer, (tuple, list)):
                if len(layer) == 2:
                    kinds.add("kv")
                elif len(layer) == 1:
                    kinds.add("mla")
                else:
                    raise _bad(f"kv_caches[{i}] has {len(layer)} tensors: pass (K, V) or (latent,)")
                planes.extend(layer)
                continue
            shape = tuple(getattr(layer, "shape", ()))
            if len(shape) >= 4 and shape[0] == 2 and fmt != "mla":
                kinds.add("kv")
                planes.extend([layer[0], layer[1]])
            else:
                kinds.add("mla")
                planes.append(layer)
        if len(kinds) > 1:
            raise _bad("kv_caches mixes (K, V) pairs and single latent tensors")
        kind = kinds.pop()
        if fmt is not None and _format_code(fmt) != _FORMATS[kind]:
            raise _bad(f"fmt={fmt!r} but kv_caches looks like {kind!r} (see KVCache.from_vllm)")
        shape = tuple(int(n) for n in getattr(planes[0], "shape", ()))
        if len(shape) < 2:
            raise _bad(
                f"kv_caches' tensors have shape {shape}: expected [num_blocks, block_size, ...]"
            )
        for j, p in enumerate(planes):
            s = tuple(int(n) for n in getattr(p, "shape", ()))
            if s != shape:
                raise _bad(f"kv_caches' tensor {j} has shape {s}, the first has {shape}: they must agree")
        per_block = 1
        for n in shape[1:]:
            per_block *= n
        bs = int(block_size) if block_size is not None else shape[1]
        if bs <= 0 or per_block % bs != 0:
            raise _bad(f"block_size {bs} does not divide a block of {per_block} elements (shape {shape})")
        return cls(
            planes,
            fmt=kind,
            dtype=dtype,
            layers=len(layers_in),
            num_blocks=shape[0],
            block_size=bs,
            hidden=per_block // bs,
            device=device,
            stream=stream,
        )

    @property
    def handle(self) -> _lib.ApdKvCache:
        """The underlying ``ApdKvCache`` handle (its id stays the same once closed)."""
        return self._handle

    @property
    def tensors(self) -> Tuple[Any, ...]:
        """The objects wrapped (kept alive as long as this cache)."""
        return self._keep

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Frees the cache handle (never the memory; a no-op if already closed).

        A save or load still running keeps using the memory until it ends;
        the tensors stay referenced by this object.
        """
        if self._closed:
            return
        self._closed = True
        handle = self._handle
        check(_lib.lib().apd_kv_cache_free(handle))

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        handle: Optional[_lib.ApdKvCache] = getattr(self, "_handle", None)
        if handle is not None and not getattr(self, "_closed", True) and _lib is not None:
            try:
                _lib.lib().apd_kv_cache_free(handle)
            except Exception:
                pass

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return (
            f"<ascend_pd.KVCache id={self._handle.id} fmt={self.fmt} dtype={self.dtype} "
            f"layers={self.layers} num_blocks={self.num_blocks} block_size={self.block_size} "
            f"hidden={self.hidden} device={self.device}{state}>"
        )
