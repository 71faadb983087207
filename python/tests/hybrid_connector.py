"""``KvOffloadConnector`` declaring vLLM's ``SupportsHMA``, for the hybrid
differential test (``test_hybrid_vllm.py``) only.

vLLM's scheduler hands a connector several KV groups only when it declares
``SupportsHMA``. kvoffload's scheduler side plans several groups; its worker
side moves one group (it refuses a hybrid ``KVCacheConfig``), so the
package's connector does not declare it yet and vLLM keeps its hybrid
manager off for it. The test engine is scheduler-only (fake workers).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

from kvoffload.vllm import KvOffloadConnector


class KvOffloadHybridConnector(KvOffloadConnector, SupportsHMA):
    """The package's connector, with vLLM's hybrid manager on."""
