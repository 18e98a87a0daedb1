#!/usr/bin/env bash
# Idempotent set-up of everything vfab needs on Debian 12, as root:
# Debian packages, a Python venv (from /usr/bin/python3, with system site
# packages so Mininet imports) holding vfab and its Python dependencies,
# and /usr/local/bin/vfab.
set -euo pipefail

VENV=${VFAB_VENV:-/opt/vfab-venv}
HERE=$(cd "$(dirname "$0")/.." && pwd)
DEBS=(openvswitch-switch openvswitch-common mininet etcd-server etcd-client libpcap0.8 libpcap-dev
      tcpdump ethtool iproute2 iputils-ping memcached redis-server python3-venv python3-dev busybox
      isc-dhcp-client dhcpcd-base gcc make libc6-dev libsqlite3-dev
      dpdk libdpdk-dev dpdk-dev meson ninja-build pkg-config libmemcached-tools nutcracker
      kea-dhcp4-server kea-ctrl-agent kea-admin dnsmasq-base
      prometheus tmux python3-matplotlib)   # promtool (the alert rules' unit tests), the server the metrics test scrapes with; tmux drives vfab top in its test; matplotlib draws 'make report'

if [ "$(id -u)" != 0 ]; then
  echo "bootstrap: must run as root (it installs Debian packages and creates network namespaces)" >&2
  exit 1
fi

missing=()
for p in "${DEBS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${missing[*]}"
  apt-get update -qq
  # Packages such as kea-dhcp4-server ship system services: the project runs its own
  # instances inside its namespaces, so none may start on the host while installing.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
stamp="$VENV/.vfab-stamp"
want="$(sha256sum "$HERE/setup.py" | cut -d' ' -f1) $HERE"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$VENV/bin/python" -c "import vfab.vid.codec, vfab.controller" 2>/dev/null; then
  echo "bootstrap: installing vfab and its Python dependencies into $VENV"
  "$VENV/bin/pip" install -q -U pip setuptools wheel
  "$VENV/bin/pip" install -q -e "$HERE[test]"
  echo "$want" > "$stamp"
fi
# elastic-KVS's native apply (ctypes; without it the store applies records in Python, slower)
make -s -C "$HERE/services/elastic-kvs/native"
# sdhcp's native lane (ctypes; without it every DHCP request is served in Python, at several times the CPU)
make -s -C "$HERE/services/sdhcp/native"
# the testbed's gate that starts DHCP clients together in their namespaces (testbed/nsgate.py)
make -s -C "$HERE/testbed/native"
ln -sf "$VENV/bin/vfab" /usr/local/bin/vfab
echo "bootstrap: ready ($("$VENV/bin/python" --version), $(ovs-vsctl --version | head -1), $(etcd --version | head -1))"
