"""vLLM general plugin (entry point ``vllm.general_plugins``: ``kvoffload``):
registers ``KvOffloadConnector`` with vLLM's ``KVConnectorFactory`` so that a
deployment names the connector alone::

    --kv-transfer-config '{"kv_connector": "KvOffloadConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000}}'

vLLM runs general plugins in every process it starts (API server, engine
core, workers), possibly more than once per process; registering twice is a
no-op here. With ``VLLM_PLUGINS`` set, vLLM loads only the plugins it names:
include ``kvoffload`` (or keep ``kv_connector_module_path``, which needs no
plugin).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: The name deployments give as ``kv_connector``.
CONNECTOR_NAME = "KvOffloadConnector"


def register() -> None:
    """Registers the connector by name (lazily: the module is imported when
    vLLM creates the connector)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM absent or of another layout: nothing to register with
        logger.debug("kvoffload: vLLM's KVConnectorFactory not importable; plugin not registered")
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvoffload.vllm", "KvOffloadConnector")
    except ValueError:
        # Already registered (vLLM loads plugins once per process, but a
        # process may call this again).
        logger.debug("kvoffload: %s already registered", CONNECTOR_NAME)
