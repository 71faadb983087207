#!/usr/bin/env bash
# Installs the pinned vLLM (vllm==0.33.0 from PyPI, about 10 GB) with pytest
# and maturin into a cached venv, once, plus an offline Hugging Face cache
# holding only facebook/opt-125m's config.json (the tests build a vLLM
# ModelConfig for it; no weights are needed). Idempotent: a venv that already
# imports vllm 0.33.0 is kept. Prints the venv's python on stdout.
# Usage: PY=$(scripts/setup-vllm.sh)
#   KVOFFLOAD_VLLM_ROOT  where the venv and the HF cache live (default ~/.cache/kvoffload)
set -euo pipefail
VLLM_VERSION=0.33.0
root="${KVOFFLOAD_VLLM_ROOT:-$HOME/.cache/kvoffload}"
venv="$root/vllm-$VLLM_VERSION"
py="$venv/bin/python"
ready() {
    [ -x "$py" ] && "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '$VLLM_VERSION')" 2>/dev/null \
        && "$py" -c "import pytest, maturin" 2>/dev/null
}
if ! ready; then
    command -v python3 >/dev/null || { echo "setup-vllm: python3 (>= 3.10) not found" >&2; exit 1; }
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || { echo "setup-vllm: python3 >= 3.10 needed, found $(python3 --version)" >&2; exit 1; }
    if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
        echo "setup-vllm: installing python3-venv (Debian)" >&2
        apt-get install -y -q python3-venv >&2 || sudo apt-get install -y -q python3-venv >&2
    fi
    echo "setup-vllm: installing vllm==$VLLM_VERSION into $venv (about 10 GB, minutes)" >&2
    rm -rf "$venv"
    mkdir -p "$root"
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip >&2
    "$venv/bin/pip" install -q --disable-pip-version-check "vllm==$VLLM_VERSION" \
        pytest==9.2.0 pytest-asyncio==1.5.0 maturin==1.16.0 >&2
    ready || { echo "setup-vllm: $venv does not import vllm $VLLM_VERSION" >&2; exit 1; }
fi

# Offline HF cache: config.json of facebook/opt-125m, nothing else.
snap="$root/hf/hub/models--facebook--opt-125m/snapshots/0000000000000000000000000000000000000000"
if [ ! -f "$snap/config.json" ]; then
    mkdir -p "$snap" "$root/hf/hub/models--facebook--opt-125m/refs"
    printf 0000000000000000000000000000000000000000 > "$root/hf/hub/models--facebook--opt-125m/refs/main"
    cat > "$snap/config.json" <<'JSON'
{
  "_name_or_path": "facebook/opt-125m",
  "activation_dropout": 0.0,
  "activation_function": "relu",
  "architectures": ["OPTForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 2,
  "do_layer_norm_before": true,
  "dropout": 0.1,
  "eos_token_id": 2,
  "ffn_dim": 3072,
  "hidden_size": 768,
  "init_std": 0.02,
  "layerdrop": 0.0,
  "max_position_embeddings": 2048,
  "model_type": "opt",
  "num_attention_heads": 12,
  "num_hidden_layers": 12,
  "pad_token_id": 1,
  "prefix": "</s>",
  "torch_dtype": "float16",
  "transformers_version": "4.21.0.dev0",
  "use_cache": true,
  "vocab_size": 50272,
  "word_embed_proj_dim": 768
}
JSON
fi
echo "$py"
