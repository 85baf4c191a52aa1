#!/usr/bin/env bash
# Install what the tests run beside warmkv, from Debian's packages, when it is not on PATH yet:
# redis-server (or Valkey) for the remote KV tier, nginx and HAProxy in front of nodes (deploy/).
# The tests start their own instances on loopback ports with configs in a temp dir: the
# packages' system services are never started (a policy-rc.d that refuses them while
# installing) and never relied on.
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"
missing=()
command -v redis-server >/dev/null || command -v valkey-server >/dev/null || missing+=(redis-server)
command -v nginx >/dev/null || missing+=(nginx)
command -v haproxy >/dev/null || missing+=(haproxy)
[ ${#missing[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null; then
    echo "install_services: ${missing[*]} not found and apt-get is not available: install them by hand" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
        echo "install_services: installing ${missing[*]} needs root (or sudo)" >&2
        exit 1
    fi
    SUDO="sudo"
fi

# invoke-rc.d asks policy-rc.d before starting a service: 101 means "not allowed".
POLICY=/usr/sbin/policy-rc.d
ours=""
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod 755 "$POLICY"
    ours=1
fi
cleanup() { if [ -n "$ours" ]; then $SUDO rm -f "$POLICY"; fi; }
trap cleanup EXIT

echo "installing ${missing[*]} with apt-get..." >&2
if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then
    echo "install_services: apt-get could not install ${missing[*]}; the remote tier and fleet tests need them" >&2
    exit 1
fi
for bin in "${missing[@]}"; do
    if ! command -v "$bin" >/dev/null; then
        echo "install_services: $bin is still not on PATH after installing it" >&2
        exit 1
    fi
done
