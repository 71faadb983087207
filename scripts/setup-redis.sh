#!/usr/bin/env bash
# Installs Debian's redis-server and redis-tools (Redis 7) when they are not
# on PATH: the remote tier's tests start real servers (and a 3-master
# cluster) on loopback. Idempotent. Without root or apt-get it says why and
# exits 0: the tests then show as ignored, with their reason.
# Usage: scripts/setup-redis.sh
set -euo pipefail
if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "setup-redis: no apt-get here: install redis-server (>= 7) by hand; the Redis tests show as ignored" >&2
    exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null; then sudo=sudo; else
        echo "setup-redis: not root and no sudo: the Redis tests show as ignored" >&2
        exit 0
    fi
fi
echo "setup-redis: installing redis-server and redis-tools (Debian)" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q >&2 || true
$sudo apt-get install -y -q --no-install-recommends redis-server redis-tools >&2
# The package's own service is not needed: the tests start their servers.
if command -v systemctl >/dev/null && systemctl is-active --quiet redis-server 2>/dev/null; then
    $sudo systemctl stop redis-server >&2 || true
fi
redis-server --version >&2
