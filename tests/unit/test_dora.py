"""dhcpclients: dora (what the lease benches and the scale test read off a capture) and quiet_ipv6."""

from __future__ import annotations

import os
import subprocess
import uuid
from ipaddress import IPv4Address

import pytest

from vfab.services.sdhcp.wire import MessageType as T
from vfab.testbed.dhcpclients import Seen, dora, quiet_ipv6
from vfab.vid.netns import netns

A, B = b"\x02\x00\x00\x00\x00\x0a", b"\x02\x00\x00\x00\x00\x0b"
IP1, IP2 = IPv4Address("10.0.0.10"), IPv4Address("10.0.0.11")
ZERO = IPv4Address("0.0.0.0")


def seen(t: float, out: bool, kind: T, chaddr: bytes = A, xid: int = 1, yiaddr: IPv4Address = ZERO) -> Seen:
    return Seen(t, out, kind, chaddr, xid, yiaddr)


def test_turnaround_pairs_each_request_with_the_reply_to_its_xid():
    got = dora([
        seen(10.000, True, T.DISCOVER),
        seen(10.001, True, T.DISCOVER, B, xid=7),
        seen(10.003, False, T.OFFER, yiaddr=IP1),              # A: 3 ms
        seen(10.006, False, T.OFFER, B, xid=7, yiaddr=IP2),    # B: 5 ms
        seen(10.020, True, T.REQUEST),
        seen(10.021, True, T.REQUEST, B, xid=7),
        seen(10.022, False, T.ACK, B, xid=7, yiaddr=IP2),      # B: 1 ms
        seen(10.030, False, T.ACK, yiaddr=IP1),                # A: 10 ms
    ])
    assert sorted(got["turnaround"]["offer"]) == pytest.approx([0.003, 0.005])
    assert sorted(got["turnaround"]["ack"]) == pytest.approx([0.001, 0.010])
    assert got["time_s"] == 0.03 and got["leased"] == 2 and got["held_twice"] == []
    assert got["start_spread_s"] == 0.001 and got["tail_s"] == 0.029   # B started last, 1 ms after A


def test_a_reply_to_another_xid_or_client_answers_nothing_and_a_retransmission_waits_too():
    got = dora([
        seen(1.0, True, T.DISCOVER),
        seen(1.1, False, T.OFFER, xid=2, yiaddr=IP1),          # another transaction of A's
        seen(1.2, False, T.OFFER, B, yiaddr=IP1),               # B's, same xid
        seen(3.0, True, T.DISCOVER),                            # A retransmits
        seen(3.5, False, T.OFFER, yiaddr=IP1),                  # answers both waits
        seen(3.6, False, T.OFFER, yiaddr=IP1),                  # a second OFFER: nobody waits any more
        seen(4.0, True, T.REQUEST),
        seen(4.2, False, T.NAK),                                # a NAK ends a REQUEST's wait
    ])
    assert sorted(got["turnaround"]["offer"]) == pytest.approx([0.5, 2.5])
    assert got["turnaround"]["ack"] == pytest.approx([0.2])
    assert got["leased"] == 0 and got["naks"] == 1 and got["time_s"] is None


def test_clients_outside_the_set_are_left_out():
    got = dora([seen(1.0, True, T.DISCOVER, B), seen(1.1, False, T.OFFER, B, yiaddr=IP2)], chaddrs={A})
    assert got["turnaround"] == {"offer": [], "ack": []} and got["clients"] == 0


def test_quiet_ipv6_leaves_a_new_interface_without_ipv6():
    """ClientFarm.create calls it in each client namespace before the link comes up."""
    if os.geteuid() != 0:
        pytest.fail("needs root (a network namespace)")
    name = f"vfx{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        with netns(f"/var/run/netns/{name}"):
            before = open("/proc/sys/net/ipv6/conf/default/disable_ipv6").read().strip()
            quiet_ipv6()
        sh = ["ip", "netns", "exec", name]
        subprocess.run([*sh, "ip", "link", "add", f"{name}a", "type", "veth", "peer", "name", f"{name}b"], check=True)
        subprocess.run([*sh, "ip", "link", "set", f"{name}a", "up"], check=True)
        flag = subprocess.run([*sh, "cat", f"/proc/sys/net/ipv6/conf/{name}a/disable_ipv6"], capture_output=True,
                              text=True, check=True).stdout.strip()
        addrs = subprocess.run([*sh, "ip", "-6", "addr", "show", "dev", f"{name}a"], capture_output=True, text=True,
                               check=True).stdout
        host = open("/proc/sys/net/ipv6/conf/default/disable_ipv6").read().strip()
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)
    assert before == "0" and flag == "1" and "inet6" not in addrs
    assert host == "0", "the test's own namespace must be left as it was"
