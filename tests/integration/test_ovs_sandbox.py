"""An OVS sandbox (dummy datapath, no namespace) driven through ``SockDatapath`` + ``OFConn``, as the scale
bench drives 64 of them: bundles commit atomically, a refused bundle leaves the table as it was, the table
reads back as committed, and the daemons stop by PID."""

from __future__ import annotations

import os

import pytest

from vfab.controller.ofconn import OpError
from vfab.controller.reconcile import diff
from vfab.fabric.flows import TABLE_ROUTE, FlowSpec, Kind, SwitchConfig, make_cookie, match
from vfab.testbed.fabric import acquire_lock, release_lock
from vfab.testbed.ofsock import ChannelError, SockDatapath
from vfab.testbed.ovsinst import OvsInstance
from vfab.testbed.procs import Supervisor, wait_for


@pytest.fixture
def sandbox(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("integration tests need root (the testbed lock)")
    acquire_lock()
    sup = Supervisor(str(tmp_path / "logs"))
    inst = OvsInstance("vfsbx", None, str(tmp_path / "ovs"), sup, sandbox=True)
    try:
        inst.start()
        inst.vsctl("add-br", "vfsbx0", "--", "set", "bridge", "vfsbx0", "protocols=OpenFlow14", "fail-mode=secure",
                   "other-config:datapath-id=00000000000000a1")
        mgmt = os.path.join(inst.rundir, "vfsbx0.mgmt")
        wait_for(lambda: os.path.exists(mgmt), 10, "the sandbox's management socket")
        chan = SockDatapath(mgmt, 0xA1)
        yield inst, chan
        chan.close()
    finally:
        inst.stop()
        sup.stop_all()
        release_lock()


def flows(n: int, port: int = 5) -> dict:
    out = {}
    for i in range(n):
        f = FlowSpec(TABLE_ROUTE, 1000, match(eth_dst=0x02FB00000000 | i), (("output", port),),
                     make_cookie(Kind.VID_ROUTE, 1, i, 1))
        out[f.key] = f
    return out


def test_bundles_commit_read_back_and_a_refused_one_changes_nothing(sandbox):
    inst, chan = sandbox
    assert "vfsbx0" in inst.vsctl("list-br")
    want = flows(500)
    assert chan.conn.commit(diff(SwitchConfig(0xA1, want), {}, {})) == 500
    have, groups = chan.conn.dump()
    assert have == want and groups == {}
    # a bundle whose last flow points at a group the switch lacks: OVS refuses it whole
    bad = dict(flows(600, port=6))
    extra = FlowSpec(TABLE_ROUTE, 1000, match(eth_dst=0x02FB0000FFFF), (("group", 77),),
                     make_cookie(Kind.VID_ROUTE, 1, 0xFFFF, 1))
    bad[extra.key] = extra
    with pytest.raises(OpError, match="OpenFlow error"):
        chan.conn.commit(diff(SwitchConfig(0xA1, bad), have, {}))
    assert chan.conn.dump()[0] == want
    assert not any(os.path.exists(f"/sys/class/net/{d}") for d in ("vfsbx0", "ovs-dummy")), \
        "a sandbox makes no kernel device"


def test_a_switch_that_is_not_there_is_a_clear_error(tmp_path):
    with pytest.raises(ChannelError, match="cannot connect"):
        SockDatapath(str(tmp_path / "nope.mgmt"), 1)
