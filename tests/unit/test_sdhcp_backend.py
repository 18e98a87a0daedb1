"""sdhcp's backend and lease store without a network: RFC 2131 conversations, bad input, records, options.

Each request goes through ``key_of`` then ``handle_batch`` exactly as the
stateful-endpoint loop calls them; replies are parsed back from the Ethernet
frames the backend builds.  Records returned by a batch are applied to a second
store (a mirror) to show they carry everything; the ``vfab service add`` path
and the server's ``--help`` are checked at the end.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
import sys
from ipaddress import IPv4Address

import pytest
from click.testing import CliRunner

from vfab.services.sdhcp import frames, ipudp, wire
from vfab.services.sdhcp.backend import SdhcpBackend
from vfab.services.sdhcp.config import parse_opts
from vfab.services.sdhcp.errors import DhcpError
from vfab.services.sdhcp.port import dhcp_filter
from vfab.services.sdhcp.store import BOUND, DECLINED, FREE, HELD, HINT_MS, RELEASED, Addr, Store, StoreError
from vfab.services.sdhcp.wire import Message, MessageType, Opt
from vfab.vid import mackey, plugin
from vfab.vid.codec import KEY_MAX
from vfab.vid.ranges import FULL, Range
from vfab.vid.state.backend import BadRequest, Request
from vfab.testbed.procs import wait_for

SERVER = IPv4Address("192.168.77.1")
OPTS = {"pool": "192.168.77.10-192.168.77.250", "mask": "24", "server": str(SERVER), "router": "192.168.77.254",
        "dns": "192.168.77.53,192.168.77.54", "lease": "600", "t1": "300", "t2": "525"}
MAC = bytes.fromhex("025d00200001")
BCAST = b"\xff" * 6


@pytest.fixture
def backend(tmp_path):
    b = SdhcpBackend(Store(str(tmp_path / "s1.sqlite"), parse_opts(OPTS)))
    yield b
    b.store.close()


def dhcp(mtype: MessageType, mac: bytes = MAC, op: int = 1, **kw) -> bytes:
    opts = {Opt.MSG_TYPE: bytes([mtype]), **kw.pop("opts", {})}
    return Message(op=op, xid=kw.pop("xid", 0x5EED), chaddr=mac, options=opts, **kw).serialize()


def send(b: SdhcpBackend, payload: bytes, src: bytes = MAC, broadcast: bool = True):
    """(reply Datagram or None, its Message or None, records) for one request."""
    req = frames.request(src, payload, broadcast)
    key = b.key_of(req)
    replies, records = b.handle_batch([Request(req, key, src)])
    if replies[0] is None:
        return None, None, records
    dg = ipudp.parse(replies[0])
    return dg, wire.parse(dg.payload), records


def lease(b: SdhcpBackend, mac: bytes = MAC) -> IPv4Address:
    _, offer, _ = send(b, dhcp(MessageType.DISCOVER, mac), mac)
    _, ack, _ = send(b, dhcp(MessageType.REQUEST, mac, opts={Opt.SERVER_ID: SERVER.packed,
                                                             Opt.REQUESTED_IP: offer.yiaddr.packed}), mac)
    assert ack.msg_type is MessageType.ACK
    return ack.yiaddr


def test_dora_offers_the_clients_first_choice_with_every_option(backend):
    dg, offer, records = send(backend, dhcp(MessageType.DISCOVER))
    pool = backend.pool
    assert offer.msg_type is MessageType.OFFER and offer.xid == 0x5EED and offer.op == 2
    assert int(offer.yiaddr) == pool.first + pool.slot(0x200001)            # slot(key): its first choice
    assert (dg.eth_dst, dg.dst_ip, dg.src_ip, dg.src_port, dg.dst_port) == (MAC, offer.yiaddr, SERVER, 67, 68)
    assert dg.eth_src == backend.vid_mac(0x200001)                          # from the VID of the client's key
    assert len(records) == 2                                                # the offer is recorded: lease + address
    _, ack, records = send(backend, dhcp(MessageType.REQUEST, opts={Opt.SERVER_ID: SERVER.packed,
                                                                    Opt.REQUESTED_IP: offer.yiaddr.packed}))
    assert ack.msg_type is MessageType.ACK and ack.yiaddr == offer.yiaddr
    assert (ack.lease_time, ack.t1, ack.t2, ack.server_id) == (600, 300, 525, SERVER)
    assert str(ack.subnet_mask) == "255.255.255.0" and ack.routers == [IPv4Address("192.168.77.254")]
    assert ack.dns_servers == [IPv4Address("192.168.77.53"), IPv4Address("192.168.77.54")]
    row = backend.store.lease(int.from_bytes(MAC, "big"))
    assert row.state == BOUND and row.ip == int(offer.yiaddr)
    assert [k for k, _ in records] == [0x200001]                            # the address row was already held


def test_renew_rebind_init_reboot_release_and_back(backend):
    ip = lease(backend)
    dg, ack, _ = send(backend, dhcp(MessageType.REQUEST, ciaddr=ip), broadcast=False)          # RENEWING
    assert ack.msg_type is MessageType.ACK and ack.yiaddr == ip and ack.ciaddr == ip and dg.dst_ip == ip
    _, ack, _ = send(backend, dhcp(MessageType.REQUEST, ciaddr=ip), broadcast=True)             # REBINDING
    assert ack.msg_type is MessageType.ACK
    _, ack, _ = send(backend, dhcp(MessageType.REQUEST, opts={Opt.REQUESTED_IP: ip.packed}))    # INIT-REBOOT
    assert ack.msg_type is MessageType.ACK and ack.yiaddr == ip
    other = ip + 1
    dg, nak, _ = send(backend, dhcp(MessageType.REQUEST, opts={Opt.REQUESTED_IP: other.packed}))
    assert nak.msg_type is MessageType.NAK and dg.dst_ip == IPv4Address("255.255.255.255") and dg.eth_dst == BCAST
    _, nak, _ = send(backend, dhcp(MessageType.REQUEST, opts={Opt.REQUESTED_IP: IPv4Address("10.1.1.1").packed}))
    assert nak.msg_type is MessageType.NAK and "not on network" in nak.message
    c = backend.counters
    assert (c["renewing"], c["rebinding"], c["init_reboot"], c["naks"]) == (1, 1, 1, 2)
    _, none, records = send(backend, dhcp(MessageType.RELEASE, ciaddr=ip, opts={Opt.SERVER_ID: SERVER.packed}))
    assert none is None and len(records) == 1 and backend.store.lease(int.from_bytes(MAC, "big")).state == RELEASED
    assert lease(backend) == ip                                             # it gets its address back


def test_a_client_unknown_here_gets_silence_and_one_from_another_server_too(backend):
    mac = bytes.fromhex("02000000abcd")
    for payload in (dhcp(MessageType.REQUEST, mac, opts={Opt.REQUESTED_IP: IPv4Address("192.168.77.20").packed}),
                    dhcp(MessageType.REQUEST, mac, ciaddr=IPv4Address("192.168.77.20"))):
        assert send(backend, payload, mac)[0] is None
    assert backend.counters["unknown_client"] == 2
    _, offer, _ = send(backend, dhcp(MessageType.DISCOVER, mac), mac)
    took_other = dhcp(MessageType.REQUEST, mac, opts={Opt.SERVER_ID: IPv4Address("192.168.77.2").packed,
                                                      Opt.REQUESTED_IP: offer.yiaddr.packed})
    assert send(backend, took_other, mac)[0] is None and backend.counters["other_server"] == 1


def test_decline_moves_the_client_elsewhere_and_holds_the_address(backend):
    ip = lease(backend)
    _, none, records = send(backend, dhcp(MessageType.DECLINE, opts={Opt.REQUESTED_IP: ip.packed,
                                                                     Opt.SERVER_ID: SERVER.packed}))
    assert none is None and len(records) == 2
    again = lease(backend)
    assert again != ip
    assert lease(backend, bytes.fromhex("025d00200002")) not in (ip, again)   # same first choice, declined skipped


def test_inform_gets_options_only_at_its_address(backend):
    ci = IPv4Address("192.168.77.5")
    dg, ack, records = send(backend, dhcp(MessageType.INFORM, ciaddr=ci), broadcast=False)
    assert ack.msg_type is MessageType.ACK and ack.yiaddr == IPv4Address(0) and ack.lease_time is None
    assert dg.dst_ip == ci and ack.routers and records == []


def test_exhaustion_is_silence_and_counted(tmp_path):
    b = SdhcpBackend(Store(str(tmp_path / "x.sqlite"), parse_opts({**OPTS, "pool": "192.168.77.10-192.168.77.12"})))
    got = {lease(b, bytes([2, 0, 0, 0, 0, i])) for i in range(3)}
    assert len(got) == 3
    assert send(b, dhcp(MessageType.DISCOVER, bytes([2, 0, 0, 0, 0, 9])), bytes([2, 0, 0, 0, 0, 9]))[0] is None
    assert b.counters["pool_exhausted"] == 1
    b.store.close()


def test_a_discover_flood_on_a_full_pool_does_not_walk_the_store_until_an_address_may_be_free(tmp_path, caplog):
    """Each DISCOVER of a flood on a full pool searched the whole slice (~20 ms at 4,000 addresses, in Python):
    a few dozen a second took a shard's whole CPU and every renewal waited behind them.  Once a search finds
    nothing, the next DISCOVERs read no address row until a write may have freed one or FULL_MS passed."""
    b = SdhcpBackend(Store(str(tmp_path / "f.sqlite"), parse_opts({**OPTS, "pool": "192.168.77.10-192.168.77.15"})))
    t = [1_700_000_000.0]
    b.clock = lambda: t[0]
    macs = [bytes([2, 0, 0, 0, 1, i]) for i in range(6)]
    got = {m: lease(b, m) for m in macs}
    assert len(set(got.values())) == 6
    new = [bytes([2, 0, 0, 0, 2, i]) for i in range(4)]
    assert send(b, dhcp(MessageType.DISCOVER, new[0]), new[0])[0] is None       # the search that finds it full
    reads: list[str] = []
    b.store.db.set_trace_callback(reads.append)
    assert send(b, dhcp(MessageType.DISCOVER, new[1]), new[1])[0] is None
    assert b.counters["pool_exhausted"] == 2
    assert not [q for q in reads if "FROM addr" in q], reads                    # no address row read
    full = [r.getMessage() for r in caplog.records if "slice full" in r.getMessage()]
    assert len(full) == 1 and "the 6 addresses" in full[0], full                # said once, for the operator
    reads.clear()
    _, ack, _ = send(b, dhcp(MessageType.REQUEST, macs[0], ciaddr=got[macs[0]]), macs[0], broadcast=False)
    assert ack.msg_type is MessageType.ACK                                      # renewals are served as before
    send(b, dhcp(MessageType.RELEASE, macs[1], ciaddr=got[macs[1]], opts={Opt.SERVER_ID: SERVER.packed}), macs[1])
    _, offer, _ = send(b, dhcp(MessageType.DISCOVER, new[1]), new[1])           # the release freed one: found
    assert offer.yiaddr == got[macs[1]]
    _, ack, _ = send(b, dhcp(MessageType.REQUEST, new[1], opts={Opt.SERVER_ID: SERVER.packed,
                                                                Opt.REQUESTED_IP: offer.yiaddr.packed}), new[1])
    assert ack.msg_type is MessageType.ACK
    assert send(b, dhcp(MessageType.DISCOVER, new[2]), new[2])[0] is None       # full again
    t[0] += int(OPTS["lease"]) + 1                                              # every lease ran out meanwhile
    _, offer, _ = send(b, dhcp(MessageType.DISCOVER, new[2]), new[2])           # the mark is not trusted past FULL_MS
    assert offer is not None and offer.yiaddr in set(got.values())
    b.store.db.set_trace_callback(None)
    b.store.close()


def test_a_shard_hands_out_only_its_slice(backend):
    backend.allocatable = lambda: [Range(0, 0x3FFFFF)]
    pool = backend.pool
    for i in range(40):
        mac = bytes([2, 0, 0, 0x10 + i, 0, i])                 # keys 0x10xx00..: all in the owned half
        ip = lease(backend, mac)
        assert pool.home_of(int(ip)) <= 0x3FFFFF
    assert sum(b - a + 1 for a, b in pool.slots([Range(0, 0x3FFFFF)])) == 61


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_before_the_loop_classifies_it_and_counted(backend):
    other = bytes.fromhex("02deadbeef01")
    cases = [
        (frames.request(MAC, b"\x01" * 100), "malformed"),
        (b"\x07" + MAC + b"\x00" + dhcp(MessageType.DISCOVER), "malformed"),           # not our request format
        (frames.request(MAC, dhcp(MessageType.OFFER, op=2)), "wrong_op"),
        (frames.request(MAC, dhcp(MessageType.OFFER)), "wrong_type"),
        (frames.request(MAC, dhcp(MessageType.DISCOVER, mac=MAC + b"\0\0", htype=6)), "bad_chaddr"),
        (frames.request(other, dhcp(MessageType.DISCOVER)), "spoofed"),               # chaddr is not the source
        (frames.request(other, dhcp(MessageType.RELEASE, ciaddr=IPv4Address("192.168.77.40"))), "spoofed"),
        (frames.request(other, dhcp(MessageType.DISCOVER, giaddr=IPv4Address("192.168.77.99"))), "relayed_dropped"),
    ]
    for payload, counter in cases:
        before = backend.counters[counter]
        with pytest.raises(BadRequest):
            backend.key_of(payload)
        assert backend.counters[counter] == before + 1, counter
    assert backend.error_reply(cases[0][0], None, "x") is None      # DHCP answers bad input with silence


def test_a_trusted_relay_is_answered_at_giaddr(tmp_path):
    b = SdhcpBackend(Store(str(tmp_path / "r.sqlite"), parse_opts({**OPTS, "relays": "192.168.77.99"})))
    relay_mac = bytes.fromhex("02aaaaaaaaaa")
    req = dhcp(MessageType.DISCOVER, giaddr=IPv4Address("192.168.77.99"), hops=1)
    dg, offer, _ = send(b, req, src=relay_mac)
    assert offer.msg_type is MessageType.OFFER and offer.giaddr == IPv4Address("192.168.77.99")
    assert (dg.dst_ip, dg.dst_port, dg.eth_dst) == (IPv4Address("192.168.77.99"), 67, relay_mac)
    b.store.close()


def test_key_of_fuzz_raises_only_bad_request(backend):
    rnd = random.Random(9)
    good = frames.request(MAC, dhcp(MessageType.DISCOVER, opts={Opt.CLIENT_ID: b"\x01" + MAC}))
    for i in range(3000):
        data = bytearray(good)
        for _ in range(rnd.randint(1, 6)):
            data[rnd.randrange(len(data))] = rnd.randrange(256)
        if i % 5 == 0:
            data = data[:rnd.randrange(len(data))]
        try:
            key = backend.key_of(bytes(data))
        except BadRequest:
            continue
        assert 0 <= key <= KEY_MAX
        replies, _ = backend.handle_batch([Request(bytes(data), key, MAC)])   # and serving it never raises
    assert sum(backend.counters.values()) > 0


def test_frame_wrapping_keeps_what_a_shard_needs():
    dg = ipudp.Datagram(BCAST, MAC, IPv4Address(0), IPv4Address("255.255.255.255"), 68, 67,
                        dhcp(MessageType.DISCOVER))
    raw = dg.serialize()
    from vfab.vid.frame import parse
    f = parse(frames.wrap(raw, bytes(6)))
    assert frames.unwrap(f.payload) == (MAC, True, dg.payload)
    for bad in (raw[:30], ipudp.Datagram(BCAST, MAC, IPv4Address(0), IPv4Address("255.255.255.255"), 68, 69,
                                         b"x").serialize(), raw[:-1] + bytes([raw[-1] ^ 0xFF])):
        with pytest.raises(DhcpError):
            frames.wrap(bad, bytes(6))
    arp = BCAST + MAC + b"\x08\x06" + bytes.fromhex("0001080006040001") + MAC + bytes(4) + bytes(6) + SERVER.packed
    assert frames.parse_arp_request(arp) == (MAC, bytes(4), SERVER.packed)
    assert frames.parse_arp_request(arp[:6] + bytes(6) + arp[12:]) is None      # sender MAC not the source
    reply = frames.arp_reply(b"\x0e" * 6, SERVER.packed, MAC, bytes(4))
    assert len(reply) == 60 and reply[:6] == MAC and reply[20:22] == b"\x00\x02"
    assert len(dhcp_filter()) == 18


# ----------------------------------------------------------------------------- records and stores


def test_records_rebuild_every_row_on_a_mirror_in_any_order(backend, tmp_path):
    records = []
    for i in range(20):
        mac = bytes([2, 1, 2, 3, 4, i])
        _, offer, r1 = send(backend, dhcp(MessageType.DISCOVER, mac), mac)
        _, _, r2 = send(backend, dhcp(MessageType.REQUEST, mac, opts={Opt.SERVER_ID: SERVER.packed,
                                                                      Opt.REQUESTED_IP: offer.yiaddr.packed}), mac)
        records += r1 + r2
    mirror = Store(str(tmp_path / "m.sqlite"), parse_opts(OPTS))
    rnd = random.Random(3)
    shuffled = [blob for _, blob in records] * 2
    rnd.shuffle(shuffled)
    mirror.apply(shuffled)
    dump = "SELECT chaddr, ip, state, expires, version FROM lease ORDER BY chaddr"
    assert mirror.db.execute(dump).fetchall() == backend.store.db.execute(dump).fetchall()
    dump = "SELECT ip, holder, state, version FROM addr ORDER BY ip"
    assert mirror.db.execute(dump).fetchall() == backend.store.db.execute(dump).fetchall()
    snap = [blob for blob, _ in backend.store.snapshot(Range(0, KEY_MAX), 512)]
    assert sum(n for _, n in backend.store.snapshot(Range(0, KEY_MAX), 512)) == backend.count(Range(0, KEY_MAX)) == 20
    assert mirror.apply(snap) == 0                                          # nothing newer: nothing changes
    assert mirror.drop(Range(0, KEY_MAX), limit=7) == 7 and mirror.drop(Range(0, KEY_MAX)) == 33
    mirror.close()


def test_a_store_refuses_another_pool(backend, tmp_path):
    _, _, records = send(backend, dhcp(MessageType.DISCOVER))
    other = Store(str(tmp_path / "o.sqlite"), parse_opts({**OPTS, "pool": "192.168.77.10-192.168.77.200"}))
    with pytest.raises(StoreError, match="another pool .* same --opt pool, mask and server"):
        other.apply([blob for _, blob in records])
    other.close()
    path = str(tmp_path / "s1.sqlite")
    with pytest.raises(StoreError, match="holds the leases of pool 192.168.77.10-192.168.77.250"):
        Store(path, parse_opts({**OPTS, "server": "192.168.77.2"}))
    again = Store(path)                                          # no options: the stored ones
    assert again.config.fingerprint == backend.config.fingerprint
    again.close()
    with pytest.raises(StoreError, match="holds no pool configuration"):
        Store(str(tmp_path / "new.sqlite"))
    with pytest.raises(StoreError, match="malformed|truncated|unknown"):
        backend.store.apply([records[0][1][:-3]])


@pytest.mark.parametrize("opts, message", [
    ({}, "needs --opt pool"),
    ({"pool": "192.168.77.10"}, "not a range: write FIRST-LAST"),
    ({"pool": "192.168.77.50-192.168.77.10"}, "runs backwards"),
    ({"mask": "255.255.0.255"}, "not a subnet mask"),
    ({"mask": "33"}, "must be /8 to /30"),
    ({"mask": "4"}, "must be /8 to /30"),
    ({"server": "192.168.77.20"}, "inside the pool"),
    ({"server": "192.168.78.1"}, "outside the subnet"),
    ({"pool": "192.168.77.0-192.168.77.20"}, "network or broadcast"),
    ({"router": "192.168.77.30"}, "outside the pool"),
    ({"lease": "5"}, "out of range: it must be 10..4294967294 seconds"),
    ({"t1": "500", "t2": "400"}, "must grow strictly"),
    ({"dns": "1.2.3"}, "not an IPv4 address"),
    ({"colour": "red"}, "takes no option colour"),
    ({"pool": "10.0.0.1-10.255.255.254", "mask": "8", "server": "10.0.0.0"}, "limit is 1048576"),
])
def test_options_are_checked_with_the_limit_and_the_fix(opts, message):
    full = {} if opts == {} else {**OPTS, **opts}
    with pytest.raises(DhcpError, match=message):
        parse_opts(full)


def test_vfab_service_add_checks_sdhcp_options_and_records_the_front_door(registry):
    from vfab.cli.main import cli

    runner = CliRunner()
    args = ["--etcd", registry.endpoint, "service", "add"]
    res = runner.invoke(cli, [*args, "dh", "--kind", "sdhcp", *sum((["--opt", f"{k}={v}"] for k, v in OPTS.items()),
                                                                    [])])
    assert res.exit_code == 0, res.output
    svc = registry.service("dh")
    assert svc.kind == "sdhcp" and svc.frontdoors == [{"kind": "dhcp4", "key": "mac-hash"}]
    res = runner.invoke(cli, [*args, "dh2", "--kind", "sdhcp", "--opt", "pool=192.168.77.10-192.168.77.250",
                              "--opt", "mask=24", "--opt", "server=192.168.77.20"])
    assert res.exit_code == 2 and "inside the pool" in res.output and "move it out of the pool" in res.output
    assert plugin.get("sdhcp").resolve("key_of")(frames.request(MAC, dhcp(MessageType.DISCOVER))) == mackey.key(MAC, mackey.HASH)
    res = runner.invoke(cli, ["--etcd", registry.endpoint, "sdhcp", "status", "dh"])
    assert res.exit_code == 0 and "sdhcp dh" in res.output


def test_server_help_teaches():
    out = subprocess.run([sys.executable, "-m", "vfab.services.sdhcp", "server", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for word in ("front door", "--opt pool=", "server=192.168.77.1", "fsync", "split, merge, move"):
        assert word in out, word
    bad = subprocess.run([sys.executable, "-m", "vfab.services.sdhcp", "server", "--service", "x", "--name", "s",
                          "--iface", "lo", "--data", "/tmp", "--opt", "pool=1.2.3.4", "--opt", "mask=24",
                          "--opt", "server=1.2.3.1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "error: --opt pool='1.2.3.4' is not a range" in bad.stderr


# ----------------------------------------------------------------------------- batches, fsyncs, the free-address search


def _batch(b: SdhcpBackend, payloads: list[tuple[bytes, bytes]]):
    """Serve (mac, DHCP message) pairs as one batch, as the loop does: key_of for each, then handle_batch."""
    reqs = []
    for mac, payload in payloads:
        req = frames.request(mac, payload)
        reqs.append(Request(req, b.key_of(req), mac))
    replies, records = b.handle_batch(reqs)
    return [wire.parse(ipudp.parse(r).payload) for r in replies], records


def _synchronous(b: SdhcpBackend) -> int:
    return b.store.db.execute("PRAGMA synchronous").fetchone()[0]   # 1 NORMAL (no fsync), 2 FULL


def test_a_burst_of_discovers_is_one_unsynced_transaction_and_its_requests_one_fsynced(backend, tmp_path):
    macs = [bytes([2, 0, 0, 0x20, 0, i]) for i in range(30)]   # neighbouring keys: one first choice for all
    offers, records = _batch(backend, [(m, dhcp(MessageType.DISCOVER, m)) for m in macs])
    ips = [int(o.yiaddr) for o in offers]
    assert ips == list(range(ips[0], ips[0] + 30))              # each found the next free address
    assert backend.pool.slot(0x200000) == ips[0] - backend.pool.first
    assert (backend.counters["batches_unsynced"], backend.counters["batches_synced"]) == (1, 0)
    assert _synchronous(backend) == 1                           # the OFFERs' commit did not wait for the disk
    assert len(records) == 60                                   # ... but every row is a record for the mirrors
    acks, _ = _batch(backend, [(m, dhcp(MessageType.REQUEST, m, opts={Opt.SERVER_ID: SERVER.packed,
                                                                      Opt.REQUESTED_IP: o.yiaddr.packed}))
                               for m, o in zip(macs, offers)])
    assert [a.msg_type for a in acks] == [MessageType.ACK] * 30 and [int(a.yiaddr) for a in acks] == ips
    assert (backend.counters["batches_unsynced"], backend.counters["batches_synced"]) == (1, 1)
    assert _synchronous(backend) == 2                           # the ACKs' commit fsync'd the log
    # a batch mixing a DISCOVER with a RELEASE is fsync'd; records applied after a relaxed batch are too
    extra = bytes([2, 0, 0, 0x30, 0, 1])
    _batch(backend, [(extra, dhcp(MessageType.DISCOVER, extra))])
    assert _synchronous(backend) == 1
    release = dhcp(MessageType.RELEASE, macs[0], ciaddr=acks[0].yiaddr, opts={Opt.SERVER_ID: SERVER.packed})
    requests = [frames.request(extra, dhcp(MessageType.DISCOVER, extra)), frames.request(macs[0], release)]
    backend.handle_batch([Request(r, backend.key_of(r), r[1:7]) for r in requests])
    assert backend.counters["releases"] == 1 and _synchronous(backend) == 2
    mirror = SdhcpBackend(Store(str(tmp_path / "m.sqlite"), parse_opts(OPTS)))
    mirror.handle_batch([])                                     # a batch of no lease: unsynced
    assert _synchronous(mirror) == 1
    assert mirror.apply([blob for _, blob in records]) == 60 and _synchronous(mirror) == 2
    mirror.store.close()


def test_the_free_address_search_resumes_where_it_ended_and_forgets_what_may_have_freed(backend):
    st, now = backend.store, 1_000_000
    lo, hi = st.pool.first, st.pool.first + 20
    st.begin()
    for ip in range(lo, lo + 5):
        st.put_addr(Addr(ip, holder=0x100 + ip, state=HELD))
    assert st.first_free(lo, hi, 1, now) == lo + 5              # a whole walk; the next starts here
    st.put_addr(Addr(lo + 5, holder=7, state=HELD))
    assert st.first_free(lo, hi, 1, now) == lo + 6
    st.put_addr(Addr(lo + 2, holder=0, state=FREE, version=1))  # freed below where the search resumes
    assert st.first_free(lo, hi, 1, now) == lo + 2
    st.commit()
    st.begin()                                                  # a rolled back grant frees its address
    st.put_addr(Addr(lo + 2, holder=9, state=HELD, version=2))
    assert st.first_free(lo, hi, 1, now) == lo + 6
    st.rollback()
    assert st.first_free(lo, hi, 1, now) == lo + 2
    st.put_addr(Addr(lo + 2, holder=0, state=DECLINED, until=now + 500, version=2))
    assert st.first_free(lo, hi, 1, now) == lo + 6              # declined: taken until now + 500
    assert st.first_free(lo, hi, 1, now + HINT_MS) == lo + 2    # a search after HINT_MS walks again
    st.put_addr(Addr(lo + 2, holder=9, state=HELD, version=3))
    assert st.first_free(lo, hi, 1, now) == lo + 6
    assert st.drop(Range(st.pool.home_of(lo), st.pool.home_of(lo))) == 1   # lo's row dropped: free again
    assert st.first_free(lo, hi, 1, now) == lo
    for ip in range(lo, hi + 1):                                # all taken: None, from a hint or not
        st.put_addr(Addr(ip, holder=0x100 + ip, state=HELD, version=9))
    assert st.first_free(lo, hi, 1, now) is None


# ----------------------------------------------------------------------------- bindings (the source guard's leases)


def test_acks_releases_and_declines_of_clients_on_the_fabric_are_offered_as_bindings_after_the_commit(backend):
    events = []
    backend.on_bindings = events.extend
    ip = lease(backend)
    c = int.from_bytes(MAC, "big")
    assert events == [(c, int(ip), events[0][2])]
    assert abs(events[0][2] / 1000 - (backend.clock() + 600)) < 5                   # until the lease ends
    send(backend, dhcp(MessageType.RELEASE, ciaddr=ip, opts={Opt.SERVER_ID: SERVER.packed}))
    assert events[-1][:2] == (c, None)
    ip = lease(backend)
    send(backend, dhcp(MessageType.DECLINE, opts={Opt.REQUESTED_IP: ip.packed, Opt.SERVER_ID: SERVER.packed}))
    assert [e[:2] for e in events[2:]] == [(c, int(ip)), (c, None)]
    events.clear()
    send(backend, dhcp(MessageType.DISCOVER, mac=bytes.fromhex("025d00200002")), src=bytes.fromhex("025d00200002"))
    assert events == []                                                               # an OFFER binds nothing


def test_a_relayed_clients_lease_binds_nothing(tmp_path):
    b = SdhcpBackend(Store(str(tmp_path / "r.sqlite"), parse_opts({**OPTS, "relays": "192.168.77.99"})))
    events = []
    b.on_bindings = events.extend
    relay_mac, relay = bytes.fromhex("02aaaaaaaaaa"), IPv4Address("192.168.77.99")
    _, offer, _ = send(b, dhcp(MessageType.DISCOVER, giaddr=relay, hops=1), src=relay_mac)
    _, ack, _ = send(b, dhcp(MessageType.REQUEST, giaddr=relay, hops=1, opts={
        Opt.SERVER_ID: SERVER.packed, Opt.REQUESTED_IP: offer.yiaddr.packed}), src=relay_mac)
    assert ack.msg_type is MessageType.ACK and events == []   # the client is behind the relay, not on a port
    b.store.close()


def test_the_binder_publishes_dhcp_hosts_leases_deletes_its_own_and_collects_ended_ones(registry):
    from vfab.services.sdhcp import bindings
    from vfab.vid.registry import schema

    guarded, plain, other = 0x025D00200001, 0x025D00200002, 0x025D00200003
    for mac, dhcp_host in ((guarded, True), (plain, False), (other, True)):
        registry.put_host(schema.Host(mac=codec_mac(mac), dpid=1, port=mac & 0xFF, dhcp=dhcp_host))
    binder = bindings.Binder(registry.endpoint, "dhcp", "s1", clock=lambda: 10_000.0)
    binder.offer([(guarded, 0xC0A84D0A, 9_000_000)])
    binder.write(registry)
    assert registry.get(schema.binding_key(codec_mac(guarded))) is None     # hosts not read yet: it waits
    binder.load_hosts(registry)
    binder.offer([(guarded, 0xC0A84D0A, 9_000_000), (plain, 0xC0A84D0B, 9_000_000), (guarded, 0xC0A84D0C, 10_600_000)])
    binder.write(registry)

    def stored():
        return {k.rsplit("/", 1)[1]: schema.Binding.from_json(v) for k, (v, _) in
                registry.get_prefix(schema.folder("bindings"))[1].items()}
    got = stored()
    assert list(got) == [codec_mac(guarded)]                                  # only a dhcp host's; the newest event
    assert (got[codec_mac(guarded)].ip, got[codec_mac(guarded)].until) == ("192.168.77.12", 10_600.0)
    assert binder.counters["not_dhcp_hosts"] == 1
    # another shard's binding of that MAC since then is not this shard's to delete
    registry.put(schema.binding_key(codec_mac(guarded)), schema.Binding(
        mac=codec_mac(guarded), ip="192.168.77.40", until=10_700.0, service="dhcp", shard="s2").to_json())
    binder.offer([(guarded, None, 10_100_000)])
    binder.write(registry)
    assert stored()[codec_mac(guarded)].shard == "s2" and binder.counters["deleted_by_others"] == 1
    binder.offer([(other, 0xC0A84D20, 10_500_000)])
    binder.write(registry)
    binder.offer([(other, None, 10_200_000)])
    binder.write(registry)
    assert list(stored()) == [codec_mac(guarded)] and binder.counters["deleted"] == 1
    # ended over GC_S ago: collected (this service's only)
    for mac, svc, until in ((other, "dhcp", 9_000.0), (plain, "other", 9_000.0)):
        registry.put(schema.binding_key(codec_mac(mac)), schema.Binding(
            mac=codec_mac(mac), ip="192.168.77.50", until=until, service=svc).to_json())
    assert binder.collect(registry) == 1
    assert sorted(stored()) == sorted([codec_mac(guarded), codec_mac(plain)])


def test_the_binder_keeps_what_etcd_refused_and_writes_it_once_etcd_answers(registry):
    from vfab.services.sdhcp import bindings
    from vfab.vid.errors import RegistryError
    from vfab.vid.registry import Registry, schema

    mac = 0x025D00200001
    registry.put_host(schema.Host(mac=codec_mac(mac), dpid=1, port=1, dhcp=True))
    binder = bindings.Binder(registry.endpoint, "dhcp", "s1")
    binder.load_hosts(registry)
    dead = Registry("127.0.0.1:9", timeout=0.5)
    binder.offer([(mac, 0xC0A84D0A, 9_000_000)])
    with pytest.raises(RegistryError):
        binder.write(dead)
    binder.offer([(0x025D00200009, 0xC0A84D0B, 9_000_000)])   # meanwhile: another client
    binder.write(registry)
    assert schema.Binding.from_json(registry.get(schema.binding_key(codec_mac(mac)))[0]).ip == "192.168.77.10"
    dead.close()


def test_a_late_binding_write_never_replaces_another_shards_later_lease(registry, tmp_path):
    """A shard that lost a client's range writes that client's binding late (etcd slow, its thread behind):
    the range's new owner has since leased the client an address that ends later.  The late write leaves the
    newer binding alone (before: it overwrote it, and the host's source guard followed the old address until
    the next renewal); a write that ends later still replaces an older one; another shard writing between
    the read and the write is noticed (compare on the mod revision) and read again."""
    from vfab.services.sdhcp import bindings
    from vfab.vid.registry import schema

    mac = 0x025D00200001
    key = schema.binding_key(codec_mac(mac))
    registry.put_host(schema.Host(mac=codec_mac(mac), dpid=1, port=1, dhcp=True))

    def newer(ip: str, until: float, shard: str = "s2") -> None:
        registry.put(key, schema.Binding(mac=codec_mac(mac), ip=ip, until=until, service="dhcp",
                                         shard=shard).to_json())

    def stored() -> schema.Binding:
        return schema.Binding.from_json(registry.get(key)[0])

    binder = bindings.Binder(registry.endpoint, "dhcp", "s1")
    binder.load_hosts(registry)
    newer("192.168.77.40", 10_700.0)
    binder.offer([(mac, 0xC0A84D0C, 10_600_000)])             # s1's lease of .12 to 10,600: older
    binder.write(registry)
    assert (stored().ip, stored().shard) == ("192.168.77.40", "s2")
    assert binder.counters["superseded"] == 1 and binder.counters["published"] == 0
    binder.offer([(mac, None, 10_650_000)])                   # its RELEASE: s2's binding is not s1's to delete
    binder.write(registry)
    assert stored().shard == "s2"
    binder.offer([(mac, 0xC0A84D0C, 10_800_000)])             # a later lease of s1's (the range came back)
    binder.write(registry)
    assert (stored().ip, stored().until, stored().shard) == ("192.168.77.12", 10_800.0, "s1")

    # s2 renews between s1's read and s1's write: s1's compare fails, it reads again and leaves s2's alone
    real = registry.get_many
    calls = []

    def racing(keys):
        got = real(keys)
        if not calls:
            newer("192.168.77.40", 11_000.0)
        calls.append(keys)
        return got
    registry.get_many = racing
    try:
        binder.offer([(mac, 0xC0A84D0C, 10_900_000)])
        binder.write(registry)
    finally:
        registry.get_many = real
    assert len(calls) == 2 and binder.counters["raced"] == 1 and binder.counters["superseded"] == 2
    assert (stored().ip, stored().until) == ("192.168.77.40", 11_000.0)
    # its periodic comparison does not take the other shard's later lease for a missing binding of its own
    binder.leases = lambda: [(mac, 0xC0A84D0C, 10_900_000)]
    assert binder.reconcile(registry) == 0
    newer("192.168.77.40", 10_000.0)                          # ... but an older one, of another address, is
    assert binder.reconcile(registry) == 1


def test_two_shards_racing_their_binding_writes_leave_the_latest_lease(registry):
    """Two shards' binder threads write the same host's binding at once, each its own leases in order, ending
    later and later (the host's range moved between them while it renewed; s1, the old owner, is behind and
    still writing when s2 is done): whatever the interleaving, etcd ends with the lease that ends last, never
    an earlier one written after it (before: the last writer won)."""
    import threading

    from vfab.services.sdhcp import bindings
    from vfab.vid.errors import RegistryError
    from vfab.vid.registry import schema

    mac = 0x025D00200001
    registry.put_host(schema.Host(mac=codec_mac(mac), dpid=1, port=1, dhcp=True))
    ends = {"s1": [10_000_000 + 2_000 * i for i in range(40)], "s2": [10_061_000 + 2_000 * i for i in range(10)]}
    errors, raced = [], []

    def shard(name: str) -> None:
        try:
            binder = bindings.Binder(registry.endpoint, "dhcp", name)
            binder.load_hosts(registry)
            for until_ms in ends[name]:
                binder.offer([(mac, 0xC0A84D0A + (name == "s2"), until_ms)])
                while True:   # as the binder's thread does: what a write could not place stays pending
                    try:
                        binder.write(registry)
                        break
                    except RegistryError as exc:
                        assert "kept changing" in str(exc)
                        raced.append(name)
        except Exception as exc:   # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=shard, args=(n,)) for n in ends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    got = schema.Binding.from_json(registry.get(schema.binding_key(codec_mac(mac)))[0])
    assert (got.until, got.shard) == (10_079.0, "s2")


def codec_mac(value: int) -> str:
    from vfab.vid.codec import int_to_mac
    return int_to_mac(value)


def test_the_binder_publishes_again_what_its_leases_hold_and_etcd_lacks(registry, tmp_path):
    """A shard killed between its ACK and its write, or etcd away then: the binding is missing although the
    lease is bound.  The binder's periodic comparison of the shard's bound leases with etcd puts it back."""
    from vfab.services.sdhcp import bindings
    from vfab.vid.registry import schema

    b = SdhcpBackend(Store(str(tmp_path / "s.sqlite"), parse_opts(OPTS)))
    macs = [bytes.fromhex(f"025d0020000{i}") for i in range(1, 4)]
    addrs = [lease(b, m) for m in macs]
    for i, m in enumerate(macs):
        registry.put_host(schema.Host(mac=m.hex(":"), dpid=1, port=i + 1, dhcp=i < 2))   # the third: not marked
    binder = bindings.Binder(registry.endpoint, "dhcp", "s1",
                             leases=lambda: b.store.bound([FULL], int(b.clock() * 1000)))
    registry.put(schema.binding_key(macs[1].hex(":")), schema.Binding(      # stale: an older lease, another address
        mac=macs[1].hex(":"), ip="192.168.77.240", until=b.clock() + 300, service="dhcp").to_json())
    binder.load_hosts(registry)
    assert binder.reconcile(registry) == 2
    binder.write(registry)
    got = {k.rsplit("/", 1)[1]: schema.Binding.from_json(v).ip
           for k, (v, _) in registry.get_prefix(schema.folder("bindings"))[1].items()}
    assert got == {macs[0].hex(":"): str(addrs[0]), macs[1].hex(":"): str(addrs[1])}
    assert binder.reconcile(registry) == 0                                              # nothing missing now
    b.store.close()


def test_a_host_marked_dhcp_gets_the_binding_of_its_lease_at_once(registry, tmp_path):
    """The binder follows the host records with a watch: a burst of clients costs no etcd read, and a host an
    operator marks dhcp while its client holds a lease is bound within a moment, without a renewal."""
    from vfab.services.sdhcp import bindings
    from vfab.vid.registry import schema

    b = SdhcpBackend(Store(str(tmp_path / "s.sqlite"), parse_opts(OPTS)))
    ip = lease(b, MAC)
    host = schema.Host(mac=MAC.hex(":"), dpid=1, port=1)
    registry.put_host(host)
    binder = bindings.Binder(registry.endpoint, "dhcp", "s1",
                             leases=lambda: b.store.bound([FULL], int(b.clock() * 1000))).start()
    try:
        wait_for(lambda: binder._hosts_ready and binder._reconcile_at > 0, 5,   # the host records read,
                 "the binder's first pass")                                      # a first pass looked at the lease
        assert registry.get(schema.binding_key(MAC.hex(":"))) is None        # not a dhcp host: nothing
        registry.put_host(schema.Host(mac=host.mac, dpid=1, port=1, dhcp=True))
        got = wait_for(lambda: registry.get(schema.binding_key(MAC.hex(":"))), 5, "the binding in etcd")
        assert got is not None and schema.Binding.from_json(got[0]).ip == str(ip)
    finally:
        binder.stop()
        b.store.close()


def test_the_binders_threads_ride_out_an_etcd_that_stops_answering(tmp_path):
    """etcd frozen (SIGSTOP) while leases are acknowledged: the binder keeps them, says so once, and publishes
    every one once etcd answers again (its own etcd here: the session's is shared)."""
    import signal

    from vfab.services.sdhcp import bindings
    from vfab.testbed.etcd import LocalEtcd, free_port
    from vfab.vid.registry import Registry, schema

    etcd = LocalEtcd(tmp_path / "etcd", free_port(), free_port())
    etcd.start(timeout=20)
    reg = Registry(etcd.endpoint)
    macs = [0x025D00200000 + i for i in range(1, 7)]
    try:
        for m in macs:
            reg.put_host(schema.Host(mac=codec_mac(m), dpid=1, port=m & 0xFF, dhcp=True))
        binder = bindings.Binder(etcd.endpoint, "dhcp", "s1").start()
        binder.offer([(macs[0], 0xC0A84D0A, 9_000_000)])
        wait_for(lambda: binder.counters["published"] >= 1, 10, "the first binding published")
        assert binder.counters["published"] == 1
        os.kill(etcd.proc.pid, signal.SIGSTOP)
        try:
            binder.offer([(m, 0xC0A84D10 + i, 9_000_000) for i, m in enumerate(macs[1:])])
            wait_for(lambda: binder.counters["failed"] >= 1, 15, "a publication failing while etcd is down")
            assert binder.counters["published"] == 1
        finally:
            os.kill(etcd.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while binder.counters["published"] < len(macs) and time.monotonic() < deadline:
            time.sleep(0.05)
        got = {k.rsplit("/", 1)[1] for k in reg.get_prefix(schema.folder("bindings"))[1]}
        assert got == {codec_mac(m) for m in macs}
        binder.stop()
    finally:
        reg.close()
        etcd.stop()


def test_a_shard_takes_the_service_records_pool_and_may_change_only_what_it_hands_out():
    from vfab.services.sdhcp.config import shard_config

    rec = shard_config({}, OPTS, "dh")                                   # no --opt: the record's
    assert rec == parse_opts(OPTS)
    mine = shard_config({"lease": "60", "t1": "30", "t2": "50"}, OPTS, "dh")
    assert (mine.lease, mine.t1, mine.t2, mine.fingerprint) == (60, 30, 50, rec.fingerprint)
    assert mine.dns == rec.dns                                           # the rest from the record
    with pytest.raises(DhcpError, match="--opt gives pool 192.168.77.10-192.168.77.200 .* but service dh's record "
                                        "says pool 192.168.77.10-192.168.77.250 .* leave --opt pool"):
        shard_config({"pool": "192.168.77.10-192.168.77.200"}, OPTS, "dh")
    assert shard_config({}, {}, "dh") is None                            # neither: the store's own
    assert shard_config(OPTS, {}, "dh") == rec                           # a record without options
    with pytest.raises(DhcpError, match="service dh's record holds options that are no valid pool"):
        shard_config({}, {**OPTS, "mask": "33"}, "dh")


def test_vfab_service_add_keeps_the_options_in_the_record_and_refuses_other_settings(registry, tmp_path):
    from vfab.cli.main import cli

    runner = CliRunner()
    base = ["--etcd", registry.endpoint, "service"]
    opts = sum((["--opt", f"{k}={v}"] for k, v in OPTS.items()), [])
    res = runner.invoke(cli, [*base, "add", "dh", "--kind", "sdhcp", *opts])
    assert res.exit_code == 0 and "options pool=192.168.77.10-192.168.77.250" in res.output, res.output
    assert registry.service("dh").opts == OPTS
    assert runner.invoke(cli, [*base, "add", "dh", "--kind", "sdhcp", *opts]).exit_code == 0   # the same: nothing
    res = runner.invoke(cli, [*base, "add", "dh", "--kind", "sdhcp", *opts, "--opt", "dns=192.168.77.9"])
    assert res.exit_code == 1 and "already exists with other settings" in res.output \
        and "vfab service del dh" in res.output, res.output
    assert registry.service("dh").opts == OPTS
    res = runner.invoke(cli, [*base, "show", "dh"])
    assert res.exit_code == 0 and "kind sdhcp, front doors dhcp4" in res.output and "server=192.168.77.1" in res.output
    import json
    assert json.loads(runner.invoke(cli, [*base, "show", "dh", "--json"]).output)["opts"] == OPTS
    bad = subprocess.run([sys.executable, "-m", "vfab.services.sdhcp", "server", "--etcd", registry.endpoint,
                          "--service", "dh", "--name", "s1", "--iface", "lo", "--data", str(tmp_path / "data"),
                          "--opt", "pool=192.168.77.10-192.168.77.100"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "but service dh's record says pool 192.168.77.10-192.168.77.250" in bad.stderr, \
        bad.stderr
    assert not os.path.exists(tmp_path / "data")              # refused before anything was created
