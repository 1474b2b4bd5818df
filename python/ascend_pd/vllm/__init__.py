"""ascend-pd as a vLLM (and vLLM-Ascend) KV connector.

Turn it on with ``--kv-transfer-config``::

    {"kv_connector": "AscendPDConnector", "kv_role": "kv_producer",
     "kv_connector_extra_config": {"config": "/path/to/prefill.yaml"}}

(``"kv_connector_module_path": "ascend_pd.vllm"`` also works where the
package's ``vllm.general_plugins`` entry point is not installed.) See
docs/vllm.md.

Importing this module imports vLLM; ``import ascend_pd`` alone does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import AscendPDConnector

__all__ = ["AscendPDConnector", "register"]


def __getattr__(name: str) -> Any:
    # Imported on first use: vLLM loads plugins early in every process, and
    # registering must not pull in vLLM's connector machinery.
    if name == "AscendPDConnector":
        from .connector import AscendPDConnector

        return AscendPDConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """vLLM's ``vllm.general_plugins`` hook: makes ``kv_connector:
    "AscendPDConnector"`` resolve to this class."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    name = "AscendPDConnector"
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, f"{__name__}.connector", name)
