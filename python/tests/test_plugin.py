"""The vLLM plugin: the installed package declares a ``vllm.general_plugins``
entry point, vLLM's own plugin loader runs it, and an engine then creates the
connector from its name alone (no ``kv_connector_module_path``) and loads a
prefix back with the computed bytes."""

from __future__ import annotations

from importlib.metadata import entry_points

import harness
from kvoffload.vllm import KvOffloadConnector
from kvoffload.vllm_plugin import CONNECTOR_NAME, register
from test_connector import PREFIX, evict_gpu_prefix, leak_free, run_checked
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory


def test_the_package_declares_the_plugin_and_vllm_loads_it():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kvoffload"]
    assert len(eps) == 1, "the installed package declares no vllm.general_plugins entry point"
    assert eps[0].value == "kvoffload.vllm_plugin:register"
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME) is KvOffloadConnector
    # vLLM may run plugins again in a process: a second registration is a no-op.
    register()
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME) is KvOffloadConnector


def test_an_engine_names_the_connector_without_its_module_path():
    register()
    e = harness.build(module=None, num_gpu_blocks=32, extra={"num_cpu_chunks": 64, "offload_prompt_only": False})
    assert isinstance(e.connector, KvOffloadConnector)
    e.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(e)
    evict_gpu_prefix(e)
    b = e.add(PREFIX + [7, 8, 9], max_tokens=3)
    assert run_checked(e) > 0
    assert b in e.loaded, "the prefix came back from the host tier"
    leak_free(e)
