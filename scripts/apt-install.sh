#!/usr/bin/env bash
# Installs Debian packages for a setup script: as root, or through sudo.
# Exits 0 once installed; exits 3, having said why on stderr, where they
# cannot be installed here (no apt-get, or neither root nor sudo), so that
# the caller can go on without them.
# Usage: scripts/apt-install.sh WHO PACKAGE...   (WHO names the caller in messages)
set -euo pipefail
who=$1
shift
if ! command -v apt-get >/dev/null; then
    echo "$who: no apt-get here: install $* by hand" >&2
    exit 3
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null; then sudo=sudo; else
        echo "$who: not root and no sudo: install $* by hand" >&2
        exit 3
    fi
fi
echo "$who: installing $* (Debian)" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q >&2 || true
$sudo apt-get install -y -q --no-install-recommends "$@" >&2
