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
# Where they cannot be installed the Redis tests show as ignored.
# Exit 3: cannot be installed here (said why); any other failure fails.
"$(dirname "$0")/apt-install.sh" setup-redis redis-server redis-tools || { rc=$?; [ "$rc" = 3 ] && exit 0; exit "$rc"; }
# The package's own service is not needed: the tests start their servers.
if command -v systemctl >/dev/null && systemctl is-active --quiet redis-server 2>/dev/null; then
    if [ "$(id -u)" = 0 ]; then systemctl stop redis-server >&2 || true; else sudo systemctl stop redis-server >&2 || true; fi
fi
redis-server --version >&2
