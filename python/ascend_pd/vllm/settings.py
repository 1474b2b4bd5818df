"""The connector's configuration: the ascend-pd YAML (transport keys) plus
the model keys filled from vLLM's own configuration.

``kv_connector_extra_config: {"config": PATH}`` names the YAML. It holds the
transport keys (channel, role, ports, buffers, modes, auth); the model keys
(``kv_num_layers``, ``kv_num_heads``, ``kv_head_size``, ``kv_hidden_size``,
``kv_dtype``, ``use_mla``, ``tp_size``) come from vLLM. A YAML may state a
model key only if it agrees with vLLM; a disagreement is an error naming
the key. ``kv_role`` and ``pd_role`` must agree: ``kv_producer`` with
``sender``, ``kv_consumer`` with ``receiver``, ``kv_both`` with ``both`` (a
sender and a receiver from the same file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from .._errors import ConfigError
from .. import _lib

#: ``kv_role`` -> the ``pd_role`` it needs.
ROLE_OF = {"kv_producer": "sender", "kv_consumer": "receiver", "kv_both": "both"}

#: Extra-config keys the connector reads (besides ``config``).
EXTRA_KEYS = ("config", "load_timeout_s", "load_wait_ms")

#: torch dtype names -> ascend-pd ``kv_dtype``.
DTYPES = {
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32",
    "torch.int8": "int8",
    "torch.uint8": "uint8",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "int8": "int8",
    "uint8": "uint8",
}

#: What a sender needs that a vLLM deployment has no use for: the
#: ProxyNotif target (the connector never sends ProxyNotif; vLLM's own
#: request flow tells the decode). Filled when the YAML leaves it out.
_SENDER_PLACEHOLDERS = {"pd_proxy_host": "127.0.0.1", "pd_proxy_port": 1}


def _err(message: str) -> ConfigError:
    return ConfigError(_lib.ERR_CONFIG, message)


@dataclass(frozen=True)
class ModelShape:
    """The model keys, as vLLM knows them (per TP rank)."""

    layers: int
    num_heads: int
    head_size: int
    dtype: str
    use_mla: bool
    tp_size: int
    tp_rank: int
    model: str

    @property
    def hidden(self) -> int:
        """Elements per token per layer and plane."""
        return self.head_size if self.use_mla else self.num_heads * self.head_size

    def keys(self) -> Dict[str, Any]:
        """The YAML model keys for this shape."""
        return {
            "kv_num_layers": self.layers,
            "kv_num_heads": self.num_heads,
            "kv_head_size": self.head_size,
            "kv_hidden_size": self.hidden,
            "kv_dtype": self.dtype,
            "use_mla": self.use_mla,
            "tp_size": self.tp_size,
        }


@dataclass
class ConnectorSettings:
    """What the connector needs from its configuration."""

    path: str
    kv_role: str
    pd_role: str
    yaml: Dict[str, Any]
    chunk_size: int
    load_timeout_s: float
    mode: str
    extra: Dict[str, Any] = field(default_factory=dict)
    #: How long a decode step that runs no tokens waits in the connector
    #: for its loads' KV to land and their copies to end (it returns the
    #: moment one ends) instead of returning and polling at the next step.
    load_wait_s: float = 0.02

    @property
    def layerwise(self) -> bool:
        """``pd_layerwise``: the sender saves each layer as the forward pass
        writes it (push mode; the library refuses it with a pull mode)."""
        return bool(self.yaml.get("pd_layerwise", False))

    def role_yaml(self, role: str, shape: ModelShape, identity: Optional[str] = None) -> str:
        """The YAML text of the library configuration for ``role``
        (``sender`` or ``receiver``) with the model keys of ``shape``, and
        ``pd_model_identity`` (unless the file sets it) from ``identity``."""
        import yaml as pyyaml

        doc = dict(self.yaml)
        doc["pd_role"] = role
        if identity and not doc.get("pd_model_identity"):
            doc["pd_model_identity"] = identity
        for k, v in shape.keys().items():
            doc[k] = v
        if role == "sender":
            for k, v in _SENDER_PLACEHOLDERS.items():
                doc.setdefault(k, v)
        else:
            # Sender keys (kv_both): the receiver would only warn they are ignored.
            doc.pop("pd_layerwise", None)
            doc.pop("pd_pull_done_port", None)
        return str(pyyaml.safe_dump(doc, sort_keys=False))


def mode_of(doc: Mapping[str, Any]) -> str:
    """``push``, ``pull-eager`` or ``pull-delay``, from the YAML's keys."""
    if not doc.get("pd_pull_mode", False):
        return "push"
    return "pull-delay" if doc.get("pd_delay_pull", False) else "pull-eager"


def load(kv_role: Optional[str], extra: Mapping[str, Any]) -> ConnectorSettings:
    """Reads and checks the YAML named by ``extra["config"]``."""
    import yaml as pyyaml

    if kv_role not in ROLE_OF:
        raise _err(
            f"kv_role is {kv_role!r}: AscendPDConnector needs kv_producer (prefill), "
            "kv_consumer (decode) or kv_both in --kv-transfer-config"
        )
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise _err(
            f"kv_connector_extra_config has unknown key(s) {unknown}: AscendPDConnector "
            f"reads {list(EXTRA_KEYS)}; put ascend-pd settings in the YAML named by 'config'"
        )
    path = extra.get("config")
    if not isinstance(path, str) or not path:
        raise _err(
            'kv_connector_extra_config has no "config": set it to the path of an '
            'ascend-pd YAML, e.g. {"config": "/etc/ascend-pd/decode.yaml"}'
        )
    path = os.path.expanduser(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise _err(f'kv_connector_extra_config "config" is {path!r}, which cannot be read: {e}') from None
    try:
        doc = pyyaml.safe_load(text)
    except pyyaml.YAMLError as e:
        raise _err(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise _err(f"{path}: expected a mapping of ascend-pd keys, found {type(doc).__name__}")
    want = ROLE_OF[kv_role]
    pd_role = doc.get("pd_role")
    if pd_role != want:
        raise _err(
            f"{path}: pd_role is {pd_role!r} but kv_role is {kv_role!r}: set pd_role: {want} "
            f"for a {kv_role} (kv_producer <-> sender, kv_consumer <-> receiver, kv_both <-> both)"
        )
    chunk_size = doc.get("chunk_size", 256)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise _err(f"{path}: chunk_size is {chunk_size!r}: it must be a positive number of tokens")
    timeout = extra.get("load_timeout_s", 30.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise _err(f"kv_connector_extra_config load_timeout_s is {timeout!r}: pass seconds > 0")
    wait_ms = extra.get("load_wait_ms", 20)
    if not isinstance(wait_ms, (int, float)) or isinstance(wait_ms, bool) or not 0 <= wait_ms <= 1000:
        raise _err(f"kv_connector_extra_config load_wait_ms is {wait_ms!r}: pass milliseconds from 0 "
                   "(poll at every step) to 1000")
    return ConnectorSettings(
        path=path,
        kv_role=kv_role,
        pd_role=want,
        yaml=doc,
        chunk_size=int(chunk_size),
        load_timeout_s=float(timeout),
        mode=mode_of(doc),
        extra=dict(extra),
        load_wait_s=float(wait_ms) / 1000.0,
    )


def check_model_keys(settings: ConnectorSettings, shape: ModelShape) -> None:
    """Raises if the YAML states a model key that contradicts vLLM."""
    problems: List[str] = []
    for key, value in shape.keys().items():
        if key not in settings.yaml:
            continue
        given = settings.yaml[key]
        if key == "kv_dtype":
            same = DTYPES.get(str(given).lower(), str(given)) == value
        else:
            same = given == value
        if not same:
            problems.append(
                f"{key} is {given!r} in the YAML but vLLM's model has {value!r} on this rank"
            )
    if problems:
        raise _err(
            f"{settings.path}: "
            + "; ".join(problems)
            + ". The connector fills the model keys from vLLM: remove them from the YAML or correct them"
        )

