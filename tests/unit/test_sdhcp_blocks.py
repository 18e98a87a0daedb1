"""Address blocks (services/sdhcp/blocks.py, agent.py): a shard that ran dry gets addresses another lends it,
no address is ever in two shards' share, records carry the row key, and the native lane decides by the same
table as the Python backend.

Before blocks (the home-key rule alone) a shard whose slice was full refused every new client while other
shards' slices were empty: ``test_a_dry_shard_serves_again_with_a_block_lent_by_another`` fails there at its
first assertion after the lend (and cannot import ``blocks``)."""

from __future__ import annotations

import os
import random
import time
from ipaddress import IPv4Address

import pytest

from vfab.services.sdhcp import agent
from vfab.services.sdhcp.backend import SdhcpBackend
from vfab.services.sdhcp.blocks import HOME, Blocks, BlockError, runs
from vfab.services.sdhcp.config import parse_opts
from vfab.services.sdhcp.pool import Pool
from vfab.services.sdhcp.store import ADDR, HEAD, HELD, KIND_ADDR, Store, unpack
from vfab.services.sdhcp.wire import MessageType, Opt
from vfab.vid import mackey
from vfab.vid.codec import KEY_MAX
from vfab.vid.ranges import Range
from tests.unit.test_sdhcp_lane import Pair, frame, lanemod, yiaddr

OPTS = {"pool": "192.168.77.10-192.168.77.73", "mask": "24", "server": "192.168.77.1", "lease": "600"}  # 64
HALF = KEY_MAX // 2


def owned_ips(table: Blocks, ranges) -> set[int]:
    return {table.pool.first + i for a, b, _ in table.owned(ranges) for i in range(a, b + 1)}


def test_an_empty_table_is_the_home_key_rule():
    pool = Pool(1000, 241)
    t = Blocks(pool)
    for ranges in ([Range(0, KEY_MAX)], [Range(0, HALF)], [Range(5, 70000), Range(0x800000, 0x9FFFFF)]):
        assert [(a, b) for a, b, _ in t.owned(ranges)] == pool.slots(ranges)
        assert all(k == HOME for _, _, k in t.owned(ranges))
        assert list(t.segments(0x123456, ranges)) == list(pool.segments(0x123456, ranges))
    assert all(t.rowkey(pool.first + i) == pool.home(i) for i in range(241))


def test_lends_and_splits_never_put_an_address_in_two_shares():
    """4 shards over random cuts of the key space; random lends (what a shard may hand out, anchored at a key
    of another) and random re-cuts (a split or merge moves keys and the blocks anchored in them): every
    address is in exactly one shard's share, and the table round-trips through its record."""
    rnd = random.Random(44)
    pool = Pool(10_000, 1000)
    table = Blocks(pool)
    for step in range(300):
        cuts = sorted(rnd.sample(range(1, KEY_MAX), 3))
        bounds = [0, *cuts, KEY_MAX + 1]
        shards = [[Range(bounds[i], bounds[i + 1] - 1)] for i in range(4)]
        shares = [owned_ips(table, s) for s in shards]
        assert sum(len(x) for x in shares) == pool.size and set().union(*shares) == set(range(10_000, 11_000))
        for s, share in zip(shards, shares):
            assert all(table.may(s, ip) for ip in share)
        lender, borrower = rnd.sample(range(4), 2)
        mine = sorted(shares[lender])
        if mine:
            give = rnd.sample(mine, min(len(mine), rnd.randint(1, 20)))
            anchor = rnd.randint(shards[borrower][0].lo, shards[borrower][0].hi)
            table = table.lent(runs(ip - pool.first for ip in give), anchor, revision=step + 1)
            assert all(table.rowkey(ip) == anchor for ip in give)
        table = Blocks.from_json(table.to_json(0xABCD), pool, 0xABCD, table.revision)
    assert 0 < len(table.blocks) < pool.size


def test_a_table_of_another_pool_or_a_broken_one_is_refused():
    pool = Pool(10, 64)
    good = Blocks(pool, [(0, 3, 5)]).to_json(0x1234)
    with pytest.raises(BlockError, match="fingerprint"):
        Blocks.from_json(good, pool, 0x9999)
    with pytest.raises(BlockError, match="overlaps"):
        Blocks(pool, [(0, 5, 1), (3, 7, 2)])
    with pytest.raises(BlockError, match="unreadable"):
        Blocks.from_json(b'{"v": 1, "pool": "00001234", "blocks": [[1, 2]]}', pool, 0x1234)


def _shard(tmp_path, name, ranges):
    be = SdhcpBackend(Store(str(tmp_path / f"{name}.sqlite"), parse_opts(OPTS), mackey.LOW24))
    be.allocatable = lambda: ranges
    be.clock = lambda: 1_800_000_000.0
    got: list = []
    be.on_exhausted = got.extend
    return be, got


def _discover(be, mac):
    raw = frame(mac, MessageType.DISCOVER)
    reply = Pair.python(be, raw)
    return None if reply is None else int(yiaddr(reply))


def test_a_dry_shard_serves_again_with_a_block_lent_by_another(tmp_path):
    """B owns the upper half of the keys, and every client's key is in it (mac-low24, MACs numbered in
    sequence): its 32 addresses run out at the 33rd client while A's 32 are untouched.  A lends what it never
    handed out; B serves the other 32, each address once, its rows under the block's anchor, and A no longer
    may hand any of them out."""
    a, _ = _shard(tmp_path, "a", [Range(0, HALF)])
    b, exhausted = _shard(tmp_path, "b", [Range(HALF + 1, KEY_MAX)])
    macs = [bytes([2, 0, 0, 0x90, 0, i]) for i in range(64)]
    got = [_discover(b, m) for m in macs[:33]]
    assert None not in got[:32] and got[32] is None and len(exhausted) == 1   # B is dry; A has 32 free
    assert sum(1 for _ in a.store.rowless(a.pool.first, a.pool.first + 63, 64)) == 64
    pool = a.pool
    lendable = [ip for ip in a.store.rowless(pool.first, pool.last, 64) if a.store.blocks.may(a.allocatable(), ip)]
    anchor = HALF + 1000
    table = a.store.blocks.lent(runs(ip - pool.first for ip in lendable), anchor, revision=7)
    a.store.blocks = b.store.blocks = table
    assert not owned_ips(table, a.allocatable()) and len(owned_ips(table, b.allocatable())) == 64
    got2 = [_discover(b, m) for m in macs[32:]]
    assert None not in got2 and len(set(got[:32] + got2)) == 64
    rows = dict(b.store.db.execute("SELECT ip, vkey FROM addr").fetchall())
    assert {rows[ip] for ip in got2} == {anchor}
    assert _discover(a, bytes([2, 0, 0, 0x10, 0, 1])) is None   # A's share is empty now


def test_address_records_carry_their_row_key(tmp_path):
    """A mirror whose table is older than the lend still files a borrowed address's row under the anchor."""
    b, _ = _shard(tmp_path, "b", [Range(0, KEY_MAX)])
    b.store.blocks = Blocks(b.pool, [(0, 63, 0x424242)], revision=3)
    ip = _discover(b, bytes([2, 0, 0, 0x90, 0, 1]))
    recs = [blob for blob, _ in b.store.snapshot(Range(0x424242, 0x424242))]
    assert any(row.ip == ip and key == 0x424242 for blob in recs for _, row, key in unpack(blob) if key is not None)
    mirror, _ = _shard(tmp_path, "m", [])
    mirror.store.apply(recs)                                       # its table: empty (home keys)
    assert mirror.store.db.execute("SELECT vkey FROM addr WHERE ip=?", (ip,)).fetchone()[0] == 0x424242


@pytest.mark.skipif(not os.path.exists(lanemod.NATIVE_PATH), reason="run 'make -C services/sdhcp/native'")
def test_the_lane_hands_out_only_the_tables_addresses_with_the_same_rows(tmp_path):
    """Half the pool lent away to a key outside the grant and a block of another half's addresses anchored in
    it: the lane offers exactly what the Python backend offers, row for row (vkey = the anchor)."""
    p = Pair(tmp_path)
    try:
        table = Blocks(p.a.pool, [(0, 100, 0xF00000), (200, 240, 0x100)], revision=2)
        p.a.store.blocks = p.b.store.blocks = table
        p.grant([(0, HALF)])
        for i in range(120):
            p.send(frame(bytes([2, 0, 0, 0x10 + (i % 0x60), 0, i]), MessageType.DISCOVER), "discover")
        assert table.size([Range(0, HALF)]) == 20 + 41
        assert all(p.kinds["discover"][:61]) and not any(p.kinds["discover"][61:])   # then dry: the loop's
        ips = [ip for ip, in p.b.store.db.execute("SELECT ip FROM addr WHERE holder != 0")]
        assert len(ips) == 61 and all(table.may([Range(0, HALF)], ip) for ip in ips)
        assert {k for k, in p.b.store.db.execute("SELECT vkey FROM addr WHERE ip >= ?", (p.a.pool.first + 200,))} \
            == {0x100}
        assert all(not (p.a.pool.first <= ip <= p.a.pool.first + 100) for ip in ips)
    finally:
        p.close()


def test_a_lender_keeps_some_unless_a_client_waits_elsewhere():
    w = agent.Want(need=20, parked=0, anchor=5, at=time.time())
    assert agent.lend_count(w, 100, 10, None) == 20          # plenty: what was asked
    assert agent.lend_count(w, 12, 10, None) == 6            # keeps half of little
    assert agent.lend_count(w, 1, 10, None) == 1             # the last address goes to who asks
    mine = agent.Want(need=10, parked=2, anchor=7, at=time.time())
    assert agent.lend_count(w, 5, 10, mine) == 0             # both short, nobody waits there
    waiting = agent.Want(need=10, parked=4, anchor=5, at=time.time())
    assert agent.lend_count(waiting, 5, 10, mine) == 3       # past our own parked clients
    assert agent.Want.from_json(w.to_json()) == w and agent.Want.from_json(b"{}") is None


def _request(be, mac, ip):
    """A SELECTING REQUEST for ``ip``; the ACKed address or None."""
    raw = frame(mac, MessageType.REQUEST, opts={Opt.SERVER_ID: IPv4Address(OPTS["server"]).packed,
                                                Opt.REQUESTED_IP: IPv4Address(ip).packed})
    reply = Pair.python(be, raw)
    return None if reply is None else int(yiaddr(reply))


def test_leases_made_under_the_home_key_rule_survive_the_first_lend(tmp_path):
    """A store written before blocks (every row at its home key, address records without a row key): its
    bound clients keep their addresses and renew them after the shard lends all it never handed out, and a
    record of the old kind is still filed at its home key."""
    a, _ = _shard(tmp_path, "a", [Range(0, HALF)])
    macs = [bytes([2, 0, 0, 0x10, 0, i]) for i in range(20)]
    before = {m: _discover(a, m) for m in macs}
    assert all(_request(a, m, ip) == ip for m, ip in before.items())
    homes = dict(a.store.db.execute("SELECT ip, vkey FROM addr").fetchall())
    assert all(homes[ip] == a.pool.home_of(ip) for ip in before.values())
    pool = a.pool
    spare = [ip for ip in a.store.rowless(pool.first, pool.last, 64) if a.store.blocks.may(a.allocatable(), ip)]
    assert len(spare) == 32 - 20
    a.store.blocks = a.store.blocks.lent(runs(ip - pool.first for ip in spare), HALF + 7, revision=9)
    assert all(_request(a, m, ip) == ip for m, ip in before.items())          # renewed, same addresses
    assert {m: _discover(a, m) for m in macs} == before                       # a client starting over too
    assert _discover(a, bytes([2, 0, 0, 0x10, 1, 0])) is None                  # nothing else is A's now
    body = ADDR.pack(pool.first + 40, 0x0200001000AA, HELD, 0)
    legacy = HEAD.pack(HEAD.size + len(body), KIND_ADDR, 1, a.store.fp, 5) + body
    m, _ = _shard(tmp_path, "m", [])
    m.store.apply([legacy])
    assert m.store.db.execute("SELECT vkey FROM addr WHERE ip=?", (pool.first + 40,)).fetchone()[0] == \
        pool.home_of(pool.first + 40)


class _FakeLoop:
    """What a BlockAgent uses of its shard's loop: the view from etcd, a store, calls run at once."""

    def __init__(self, registry, store, name):
        from types import SimpleNamespace
        from vfab.vid.state.view import read_view
        self.registry, self.name = registry, name
        self.service = SimpleNamespace(name="dbk")
        self.backend = SimpleNamespace(store=store, clock=lambda: 1_800_000_000.0)
        self.lease = SimpleNamespace(id=0)
        self.view = read_view(registry, "dbk")
        self._thread = None
        self.changed = 0

    def call(self, fn, wait=True, timeout=10.0):
        return fn()

    def _authoritative(self):
        return True

    def allocatable(self):
        return [r.range for r in self.view.owned_by(self.name)]

    def blocks_changed(self):
        self.changed += 1

    def parked_count(self):
        return 0


def test_a_lend_is_one_fenced_transaction_and_a_lost_compare_lifts_the_fence(registry, tmp_path):
    """Against real etcd: A lends to B's want (the table, the want's deletion, one transaction); a second
    lend built on a table that changed meanwhile, or by a shard that no longer owns the range, writes
    nothing and leaves A free to hand its addresses out again."""
    from vfab.vid.registry import schema
    registry.create_service("dbk", kind="sdhcp", frontdoors=[{"kind": "dhcp4"}])
    registry.assign("dbk", Range(0, KEY_MAX), "a")
    registry.assign("dbk", Range(HALF + 1, KEY_MAX), "b")
    store = Store(str(tmp_path / "a.sqlite"), parse_opts(OPTS), mackey.LOW24)
    try:
        loop = _FakeLoop(registry, store, "a")
        ag = agent.BlockAgent(loop, registry)
        ag._read_table()
        assert ag.confirmed is not None and ag.checked == (Range(0, HALF),)
        wkey = schema.sdhcp_want_key("dbk", "b")
        registry.put(wkey, agent.Want(10, 1, HALF + 5, time.time()).to_json())
        want_rev = registry.get(wkey)[1]
        ag._lend_to("b", agent.Want(10, 1, HALF + 5, time.time()), want_rev, 10)
        raw, rev = registry.get(schema.sdhcp_blocks_key("dbk"))
        table = Blocks.from_json(raw, store.pool, store.fp, rev)
        assert sum(b - a + 1 for a, b, _ in table.blocks) == 10 and registry.get(wkey) is None
        assert store.blocks.blocks == table.blocks and ag.lending is None and ag.counters["lent"] == 10
        assert store.blocks.size([Range(0, HALF)]) == 32 - 10
        # another lend whose compare fails: the table moved on (another lender) behind A's back
        registry.put(wkey, agent.Want(5, 1, HALF + 5, time.time()).to_json())
        want_rev = registry.get(wkey)[1]
        registry.put(schema.sdhcp_blocks_key("dbk"), table.lent([(40, 41)], HALF + 9).to_json(store.fp))
        ag._lend_to("b", agent.Want(5, 1, HALF + 5, time.time()), want_rev, 5)
        assert ag.counters["lend_conflicts"] == 1 and ag.lending is None
        assert store.blocks.size([Range(0, HALF)]) == 32 - 10          # the fence is lifted
        assert registry.get(wkey) is not None                             # the want stays for another try
        # A's range changed after the map A's fence decided by (a new epoch, still A's): nothing written
        ag._read_table()
        registry.assign("dbk", Range(0, HALF), "a")
        before = registry.get(schema.sdhcp_blocks_key("dbk"))
        ag._lend_to("b", agent.Want(5, 1, HALF + 5, time.time()), registry.get(wkey)[1], 5)
        assert registry.get(schema.sdhcp_blocks_key("dbk")) == before and ag.lending is None
        # A no longer owns its range (a move it has not seen): nothing written, fence lifted
        registry.assign("dbk", Range(0, HALF), "c")
        before = registry.get(schema.sdhcp_blocks_key("dbk"))
        ag._lend_to("b", agent.Want(5, 1, HALF + 5, time.time()), registry.get(wkey)[1], 5)
        assert registry.get(schema.sdhcp_blocks_key("dbk")) == before and ag.lending is None
        assert store.blocks.size([Range(0, HALF)]) == 32 - 10
    finally:
        store.close()
