"""The model identity: what must be equal on a prefill and a decode for their
KV to be interchangeable, beyond what a request carries.

Its parts, each compared by name so a mismatch says which one differs:

``weights``
    A fingerprint of the checkpoint's files: every weight file's name and
    size and a digest of windows sampled through it (its first 64 KiB, where
    a safetensors header lists every tensor, and 16 windows spread over the
    rest). Two deployments pointing at copies of the same files on other
    paths or hosts agree; another revision, a fine-tune, a quantized export
    or a re-sharded checkpoint differ. A model given by a hub id whose files
    are not found locally is named by id and revision.
``config``
    The effective model config vLLM loaded (its ``hf_config``, after
    ``hf_overrides``: RoPE scaling, sliding windows, head counts), less the
    fields that name a path or a library version.
``dtype``, ``kv_cache_dtype``, ``quantization``
    As vLLM runs the model.
``geometry``
    Layers, total KV heads, head size, MLA.
``chunk_size``, ``key_format``
    How prompts are cut and keyed.

The same fingerprint names a LoRA adapter's content (:func:`adapter_identity`),
so re-pointing an adapter name at other weights, or reloading it in place,
gives other keys.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .keys import KEY_FORMAT, model_tag

log = logging.getLogger("vllm.ascend_pd")

#: Files whose content decides a model's or an adapter's weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".ckpt")
#: Files whose content decides its configuration.
CONFIG_FILES = ("config.json", "adapter_config.json", "params.json", "quant_config.json",
                "quantize_config.json", "hf_quant_config.json")
#: Bytes read at the start of each weight file and per sampled window.
HEAD_BYTES = 64 << 10
WINDOW_BYTES = 4 << 10
WINDOWS = 16
#: Config fields that name where or with what the config was written, not the model.
VOLATILE_CONFIG_KEYS = ("_name_or_path", "_commit_hash", "transformers_version", "_attn_implementation",
                        "_attn_implementation_autoset", "name_or_path")


@dataclass(frozen=True)
class ModelIdentity:
    """The parts of a model's identity (see the module docs) and their digest."""

    parts: Tuple[Tuple[str, str], ...]

    @property
    def tag(self) -> str:
        """One digest of every part: the root of every chunk key."""
        return model_tag(*self.parts)

    def as_dict(self) -> Dict[str, str]:
        return dict(self.parts)

    def differences(self, other: Dict[str, Any]) -> List[str]:
        """The parts where ``other`` (another side's :meth:`as_dict`) differs,
        as ``"name: theirs != ours"``."""
        mine = self.as_dict()
        out = []
        for name in sorted(set(mine) | set(other)):
            if str(other.get(name)) != mine.get(name):
                out.append(f"{name}: {other.get(name)!r} != {mine.get(name)!r}")
        return out


def _window_offsets(size: int) -> List[int]:
    if size <= HEAD_BYTES:
        return []
    span = size - HEAD_BYTES - WINDOW_BYTES
    if span <= 0:
        return [HEAD_BYTES]
    return sorted({HEAD_BYTES + span * i // (WINDOWS - 1) for i in range(WINDOWS)})


def _file_digest(path: str, size: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(HEAD_BYTES))
        for off in _window_offsets(size):
            f.seek(off)
            h.update(f.read(WINDOW_BYTES))
    return h.digest()


_DIR_CACHE: Dict[Tuple[str, Tuple[Tuple[str, int, int], ...]], str] = {}


def files_fingerprint(directory: str) -> Optional[str]:
    """A fingerprint of the weight and config files in ``directory`` (not
    recursive into other models): ``None`` if it holds none. Cached while
    no file's size or modification time changes."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return None
    stats: List[Tuple[str, int, int]] = []
    for name in names:
        if not (name.endswith(WEIGHT_SUFFIXES) or name in CONFIG_FILES or name.endswith(".index.json")):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if os.path.isfile(path):
            stats.append((name, st.st_size, st.st_mtime_ns))
    if not any(n.endswith(WEIGHT_SUFFIXES) for n, _, _ in stats):
        return None
    cache_key = (os.path.realpath(directory), tuple(stats))
    hit = _DIR_CACHE.get(cache_key)
    if hit is not None:
        return hit
    h = hashlib.blake2b(digest_size=16)
    for name, size, _ in stats:
        path = os.path.join(directory, name)
        h.update(struct.pack("<Q", len(name)) + name.encode() + struct.pack("<Q", size))
        if name.endswith(WEIGHT_SUFFIXES):
            h.update(_file_digest(path, size))
        else:
            with open(path, "rb") as f:
                h.update(f.read())
    out = h.hexdigest()
    _DIR_CACHE[cache_key] = out
    return out


def _hub_snapshot(model: str, revision: Optional[str]) -> Optional[str]:
    """The local snapshot of hub model ``model``, if it is already downloaded."""
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:
        return None


def weights_identity(model: str, revision: Optional[str]) -> str:
    """The ``weights`` part of a model at ``model`` (a directory or a hub id)."""
    directory = model if os.path.isdir(model) else _hub_snapshot(model, revision)
    fp = files_fingerprint(directory) if directory else None
    if fp is not None:
        return fp
    return f"{model}@{revision or 'unpinned'}"


def adapter_identity(name: str, path: Optional[str]) -> str:
    """A LoRA adapter by its content: its name and the fingerprint of its
    files (its name and path when they cannot be read here)."""
    fp = files_fingerprint(path) if path and os.path.isdir(path) else None
    return f"{name}:{fp}" if fp is not None else f"{name}@{path or ''}"


def config_identity(hf_config: Any) -> str:
    """A digest of the effective model config (less paths and versions)."""
    try:
        d = hf_config.to_dict()
    except Exception:
        d = dict(getattr(hf_config, "__dict__", {}))
    for k in VOLATILE_CONFIG_KEYS:
        d.pop(k, None)
    text = json.dumps(d, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def model_identity(vllm_config: Any, geometry: str, chunk_size: int) -> ModelIdentity:
    """The identity of the model vLLM runs (see the module docs)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    parts = (
        ("weights", weights_identity(str(mc.model), getattr(mc, "revision", None))),
        ("config", config_identity(mc.hf_config)),
        ("dtype", str(mc.dtype).replace("torch.", "")),
        ("kv_cache_dtype", str(getattr(cc, "cache_dtype", "auto"))),
        ("quantization", str(getattr(mc, "quantization", None))),
        ("geometry", geometry),
        ("chunk_size", str(int(chunk_size))),
        ("key_format", str(KEY_FORMAT)),
    )
    ident = ModelIdentity(parts)
    log.info("ascend-pd model identity %s: %s", ident.tag, dict(parts))
    return ident
