"""Splitting by the records' median (issue 44): the shard reports it, the balancer splits there when told.

Clustered clients (sequential MACs under the old key, or any skew) sit in a narrow part of a range; a split at
the middle of the key range then gives the spare none of them.  With ``split_median=1`` the balancer splits
at the key below which half of the range's records lie (the owner's load report, ``Store.median_key``).
"""

from __future__ import annotations

import dataclasses

from vfab.controller.balancer import Balancer, BalancerConfig, RangeObs, ServiceObs
from vfab.services.sdhcp.backend import SdhcpBackend
from vfab.services.sdhcp.config import parse_opts
from vfab.services.sdhcp.store import Store
from vfab.vid import mackey
from vfab.vid.codec import KEY_MAX
from vfab.vid.ranges import FULL, Range
from vfab.vid.state.housekeeper import Housekeeper

CFG = BalancerConfig(split_rate=1000.0, merge_rate=100.0, split_window=3.0, min_interval=0.0)


def hot(median: int | None) -> ServiceObs:
    r = RangeObs(0, KEY_MAX, "a", epoch=1, rate=5000.0, keys=1000, median=median)
    return ServiceObs("dh", ranges=(r,), spares=("sp",), stateful=True)


def first_split(cfg: BalancerConfig, median: int | None):
    bal = Balancer(cfg)
    for t in range(30):
        got = bal.decide(float(t), [hot(median)])
        if got:
            return got[0]
    return None


def test_split_at_the_median_record_key_when_asked():
    d = first_split(dataclasses.replace(CFG, split_median=1), 0x0203E8)
    assert d.action == "split" and d.ranges == ((0x0203E8, KEY_MAX),) and "median record key 0x0203e8" in d.reason


def test_split_in_the_middle_by_default_or_without_a_median():
    assert first_split(CFG, 0x0203E8).ranges == ((0x800000, KEY_MAX),)
    assert first_split(dataclasses.replace(CFG, split_median=1), None).ranges == ((0x800000, KEY_MAX),)
    assert first_split(dataclasses.replace(CFG, split_median=1), 0).ranges == ((0x800000, KEY_MAX),)  # at lo: no


def test_the_store_reports_the_median_key_of_its_clients(tmp_path):
    """1,000 sequential MACs under the old key all sit in 0x020300..0x0206e7: the median is among them, where
    the middle of the key space (0x800000) has none on its upper side."""
    st = Store(str(tmp_path / "s.sqlite"), parse_opts({"pool": "10.0.0.10-10.0.15.250", "mask": "20",
                                                       "server": "10.0.0.1"}), mackey.LOW24)
    macs = [0x000C01020300 + i for i in range(1000)]
    st.begin(False)
    from vfab.services.sdhcp.store import Lease
    for m in macs:
        st.put_lease(Lease(m))
    st.commit()
    b = SdhcpBackend(st)
    keys = sorted(m & KEY_MAX for m in macs)
    assert b.median_key(FULL, b.count(FULL)) == keys[500]
    assert b.median_key(Range(0x800000, KEY_MAX), 0) == 0xC00000   # no records: the middle
    st.close()


def test_the_load_report_carries_the_median_where_the_backend_tells_it(tmp_path):
    st = Store(str(tmp_path / "s.sqlite"), parse_opts({"pool": "10.0.0.10-10.0.0.250", "mask": "24",
                                                       "server": "10.0.0.1"}), mackey.HASH)
    from vfab.services.sdhcp.store import Lease
    st.begin(False)
    for m in range(0x000C01020300, 0x000C01020300 + 10):
        st.put_lease(Lease(m))
    st.commit()
    hk = Housekeeper.__new__(Housekeeper)
    hk.loop = type("L", (), {"backend": SdhcpBackend(st)})()
    hk._counts = {}
    assert hk._count(FULL) == 10
    median = hk._counts[(FULL.lo, FULL.hi)][3]
    assert median == sorted(mackey.key(m) for m in range(0x000C01020300, 0x000C01020300 + 10))[5]
    st.close()


def test_status_warns_before_a_shard_runs_out():
    from vfab.services.sdhcp.cli import running_out

    base = {"owns": ["0x000000-0x3fffff"], "slice": 250, "declined": 0, "counters": {}}
    assert running_out({**base, "held": 100, "pool_use": 40.0}) is None
    warn = running_out({**base, "held": 230, "pool_use": 92.0})
    assert warn.startswith("20 of its 250 addresses free (92% in use)") and "asks the other shards" in warn
    assert running_out({**base, "held": 250, "pool_use": 100.0, "counters": {"pool_exhausted": 7}}) \
        .startswith("refused 7 DISCOVERs")
    assert "no address of the pool" in running_out({**base, "slice": 0, "held": 0, "pool_use": 0.0})
    assert running_out({**base, "owns": [], "held": 250, "pool_use": 100.0}) is None   # a mirror or a spare
