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

    Args:
        tensors: the tensors (see above).
        fmt: ``"kv"`` (K and V planes) or ``"mla"`` (one latent plane per layer).
        dtype: the element type; inferred from numpy arrays and torch
            tensors when omitted.
        layers: transformer layers.
        num_blocks: blocks per tensor.
        block_size: tokens per block.
        hidden: elements per token (num_kv_heads * head_size, or the MLA latent size).
        device: -1 for host memory, or the NPU id of device memory.
        stream: optional ``aclrtStream`` of the engine (NPU caches only).

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
        device: int = _lib.DEVICE_CPU,
        stream: Any = None,
    ) -> None:
        self._handle = _lib.ApdKvCache(0)
        self._closed = True  # until wrapped
        if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
            raise TypeError("tensors must be a list of tensors (see KVCache's documentation)")
        memories = [_memory_of(t, i) for i, t in enumerate(tensors)]
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
        fmt_code = _format_code(fmt)
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
        check(_lib.lib().apd_kv_cache_wrap(ctypes.byref(desc), ctypes.byref(out)))
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
        if device is None:
            dev = getattr(planes[0], "device", None)
            dev_type = getattr(dev, "type", "cpu")
            if dev_type == "cpu" or dev is None:
                device = _lib.DEVICE_CPU
            else:
                index = getattr(dev, "index", None)
                device = int(index) if index is not None else 0
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
