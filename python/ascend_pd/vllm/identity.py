"""The model identity: what must be equal on a prefill and a decode for their
KV to be interchangeable, beyond what a request carries.

Its parts, each compared by name so a mismatch says which one differs:

``weights``
    A fingerprint of the checkpoint's files: every weight and config file's
    name, size and the digest of its whole content (computed once per file
    and remembered on disk, under ``ASCEND_PD_CACHE_DIR`` or
    ``~/.cache/ascend-pd``, by path, size and modification time). Two
    deployments pointing at copies of the same files on other paths or
    hosts agree; another revision, a fine-tune (even of one layer), a
    quantized export or a re-sharded checkpoint differ. A model given by a
    hub id whose files are not found locally is named by id and revision.
``config``
    The effective model config vLLM loaded (its ``hf_config``, after
    ``hf_overrides``: RoPE scaling, sliding windows, head counts; its
    ``_commit_hash`` for a hub model), less the fields that name a path or
    a library version.
``max_model_len``
    Only when the config scales RoPE: some scalings (LongRoPE, dynamic NTK)
    pick their factors from the context length vLLM runs with.
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
#: Bytes read per step while hashing a file.
READ_BYTES = 8 << 20
#: Config fields that name where or with what the config was written, not the model.
VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_attn_implementation",
                        "_attn_implementation_autoset", "name_or_path")
#: Directories fingerprinted in this process, remembered (bounded).
_DIR_CACHE_MAX = 256


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


def _cache_file() -> str:
    base = os.environ.get("ASCEND_PD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ascend-pd")
    return os.path.join(base, "file-digests.json")


def _load_digests() -> Dict[str, str]:
    try:
        with open(_cache_file(), encoding="utf-8") as f:
            data = json.load(f)
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store_digests(digests: Dict[str, str]) -> None:
    path = _cache_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(digests, f)
        os.replace(tmp, path)
    except OSError as e:  # a cache only: the digests are recomputed next time
        log.debug("ascend-pd: file digests not cached in %s: %s", path, e)


def _file_digest(path: str, size: int, mtime_ns: int, digests: Dict[str, str]) -> str:
    """The digest of a file's whole content (remembered by path, size and
    modification time)."""
    key = f"{os.path.realpath(path)}|{size}|{mtime_ns}"
    hit = digests.get(key)
    if hit is not None:
        return hit
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            if not block:
                break
            h.update(block)
    digests[key] = h.hexdigest()
    return digests[key]


_DIR_CACHE: Dict[Tuple[str, Tuple[Tuple[str, int, int], ...]], str] = {}


def files_fingerprint(directory: str) -> Optional[str]:
    """A fingerprint of the weight and config files in ``directory`` (not
    recursive): ``None`` if it holds no weight file. Raises ``OSError``
    if a file cannot be read."""
    names = sorted(os.listdir(directory))
    stats: List[Tuple[str, int, int]] = []
    for name in names:
        if not (name.endswith(WEIGHT_SUFFIXES) or name in CONFIG_FILES or name.endswith(".index.json")):
            continue
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            st = os.stat(path)
            stats.append((name, st.st_size, st.st_mtime_ns))
    if not any(n.endswith(WEIGHT_SUFFIXES) for n, _, _ in stats):
        return None
    cache_key = (os.path.realpath(directory), tuple(stats))
    hit = _DIR_CACHE.get(cache_key)
    if hit is not None:
        return hit
    digests = _load_digests()
    before = len(digests)
    h = hashlib.blake2b(digest_size=16)
    for name, size, mtime_ns in stats:
        h.update(struct.pack("<Q", len(name)) + name.encode() + struct.pack("<Q", size))
        h.update(_file_digest(os.path.join(directory, name), size, mtime_ns, digests).encode())
    if len(digests) != before:
        _store_digests(digests)
    out = h.hexdigest()
    if len(_DIR_CACHE) >= _DIR_CACHE_MAX:
        _DIR_CACHE.pop(next(iter(_DIR_CACHE)))
    _DIR_CACHE[cache_key] = out
    return out


def _hub_snapshot(model: str, revision: Optional[str], download_dir: Optional[str]) -> Optional[str]:
    """The local snapshot of hub model ``model``, if it is already downloaded
    (where vLLM downloads: ``download_dir``, else the hub's cache)."""
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True))
    except Exception:
        return None


def weights_identity(model: str, revision: Optional[str], download_dir: Optional[str] = None) -> str:
    """The ``weights`` part of a model at ``model`` (a directory or a hub id)."""
    directory = model if os.path.isdir(model) else _hub_snapshot(model, revision, download_dir)
    fp = files_fingerprint(directory) if directory else None
    if fp is not None:
        return fp
    return f"{model}@{revision or 'unpinned'}"


def adapter_identity(name: str, path: Optional[str]) -> Optional[str]:
    """A LoRA adapter by its content: its name and the fingerprint of its
    files, or its name and path when its directory holds none; ``None``
    when its files cannot be read (the request's KV cannot be named)."""
    try:
        fp = files_fingerprint(path) if path and os.path.isdir(path) else None
    except OSError as e:
        log.warning("ascend-pd: LoRA adapter %r at %r cannot be read (%s): its requests get keys of their own",
                    name, path, e)
        return None
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


def _scales_rope(hf_config: Any) -> bool:
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    for name in ("rope_scaling", "rope_parameters"):
        v = getattr(text, name, None)
        if isinstance(v, dict) and (v.get("rope_type") or v.get("type")) not in (None, "default"):
            return True
    return False


def model_identity(vllm_config: Any, geometry: str, chunk_size: int) -> ModelIdentity:
    """The identity of the model vLLM runs (see the module docs)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    parts: Tuple[Tuple[str, str], ...] = (
        ("weights", weights_identity(str(mc.model), getattr(mc, "revision", None), download_dir)),
        ("config", config_identity(mc.hf_config)),
        ("dtype", str(mc.dtype).replace("torch.", "")),
        ("kv_cache_dtype", str(getattr(cc, "cache_dtype", "auto"))),
        ("quantization", str(getattr(mc, "quantization", None))),
        ("geometry", geometry),
        ("chunk_size", str(int(chunk_size))),
        ("key_format", str(KEY_FORMAT)),
    )
    if _scales_rope(mc.hf_config):
        parts += (("max_model_len", str(getattr(mc, "max_model_len", None))),)
    ident = ModelIdentity(parts)
    log.info("ascend-pd model identity %s: %s", ident.tag, dict(parts))
    return ident
