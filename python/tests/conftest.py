"""pytest setup, before vLLM is imported: CPU, offline, the Hugging Face cache
the project's installer made (scripts/setup-vllm.sh), and this folder on the
path for ``harness``."""

import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault(
    "HF_HOME", os.environ.get("KVOFFLOAD_HF_HOME", os.path.expanduser("~/.cache/kvoffload/hf"))
)
sys.path.insert(0, os.path.dirname(__file__))
