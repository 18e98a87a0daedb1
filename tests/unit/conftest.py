"""Unit-test fixtures shared by several files: a private network namespace with a veth pair, a small disk."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from vfab.vid.transport import RawPort

ROOT = os.geteuid() == 0 and shutil.which("ip") is not None


class Netns:
    """A private network namespace with a veth pair ``a`` <-> ``b`` inside."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.name = f"vfx{tag}"
        self.a, self.b = f"vfx{tag}a", f"vfx{tag}b"

    def sh(self, *cmd: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.name, *cmd], check=True, capture_output=True)

    def create(self) -> None:
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True)
        self.sh("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        self.sh("sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
        self.sh("ip", "link", "add", self.a, "type", "veth", "peer", "name", self.b)
        for dev in ("lo", self.a, self.b):
            self.sh("ip", "link", "set", dev, "up")

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    def port(self, iface: str, rx: str = "ovs", **kw) -> RawPort:
        return RawPort(iface, rx, netns=f"/var/run/netns/{self.name}", **kw)


@pytest.fixture
def ns():
    if not ROOT:
        pytest.fail("these tests need root and iproute2 (raw sockets, network namespaces)")
    n = Netns()
    try:
        n.create()
        yield n
    finally:
        n.delete()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert n.name not in left, f"namespace {n.name} was not removed"


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (a disk that fills up), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.fail("this test mounts a tmpfs: run as root")
    mnt = tmp_path / f"vfx-full-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
