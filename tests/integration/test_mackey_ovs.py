"""The dhcp4 front door's ``mac-hash`` key on real OVS: the key the switch writes is ``vfab.vid.mackey``'s.

Service ``dhk`` gets a dhcp4 door with ``key: mac-hash`` (what ``vfab service add --kind sdhcp`` writes).
The controller installs its door flows (``multipath`` + ``move``, encoded by ``controller/ofmsg.py``); the
test reads them back from OVS, and traces DHCP frames through them with ``ofproto/trace`` (each host's own
MAC, from table 0 through the route) and ``ofproto/trace-packet-out`` (the same actions, as installed, for
MACs numbered the ways real MACs are: in sequence, in strides of 256, Docker's, random).  Every VID OVS
computes must be the one the shards compute in Python (and in C: ``test_sdhcp_lane.py`` checks the lane
against Python).
"""

from __future__ import annotations

import random
import re
import subprocess

import pytest

from vfab.vid import codec, mackey
from vfab.vid.ranges import Range
from vfab.vid.registry import schema

SVC = "dhk"
OWNER_HOST = "vfh1"
DL_DST = re.compile(r"dl_dst=([0-9a-f:]{17})")


@pytest.fixture(scope="module")
def door(testbed):
    reg = testbed.registry
    svc = reg.create_service(SVC)
    svc = schema.Service(name=SVC, id=svc.id, frontdoors=[{"kind": "dhcp4", "key": mackey.HASH}])
    reg.put(schema.service_key(SVC), svc.to_json())
    ep = schema.Endpoint(service=SVC, name="o", mac=testbed.hosts[OWNER_HOST]["mac"], rx="bpf", host=OWNER_HOST)
    reg.put(schema.endpoint_key(SVC, "o"), ep.to_json())
    testbed.wait_revision(reg.assign(SVC, Range(0, codec.KEY_MAX), "o"))
    yield svc
    reg.delete_service(SVC)


def _trace(*args: str) -> str:
    out = subprocess.run(["ovs-appctl", *args], capture_output=True, text=True)
    assert out.returncode == 0, f"ovs-appctl {' '.join(args)}: {out.stderr}{out.stdout[-2000:]}"
    return out.stdout


def _final_dst(out: str) -> int:
    final = next(ln for ln in out.splitlines() if ln.startswith("Final flow:"))
    m = DL_DST.search(final)
    assert m, f"no dl_dst in {final!r}"
    return codec.mac_to_int(m.group(1))


def _dhcp_flow(port: int, mac: int) -> str:
    return (f"udp,in_port={port},dl_src={codec.int_to_mac(mac)},dl_dst=ff:ff:ff:ff:ff:ff,nw_src=0.0.0.0,"
            f"nw_dst=255.255.255.255,udp_src=68,udp_dst=67")


def _door_flows(testbed, svc) -> list[str]:
    return [f for f in testbed.dump_flows("vfbs1") if "priority=400" in f and "tp_dst=67" in f]


def test_door_flows_hash_the_mac(testbed, door):
    flows = _door_flows(testbed, door)
    assert flows, testbed.dump_flows("vfbs1")
    for f in flows:
        assert "multipath(eth_src,0,modulo_n,65536,0,NXM_OF_ETH_DST[8..23])" in f, f
        assert "move:NXM_OF_ETH_SRC[0..7]->NXM_OF_ETH_DST[0..7]" in f, f


def test_each_hosts_dhcp_frame_gets_the_key_the_shards_compute(testbed, door):
    for host, info in testbed.hosts.items():
        if info["dpid"] != testbed.hosts[OWNER_HOST]["dpid"] or host == OWNER_HOST:
            continue
        mac = codec.mac_to_int(info["mac"])
        out = _trace("ofproto/trace", "vfbs1", _dhcp_flow(info["port"], mac))
        want = codec.encode(door.id, mackey.key(mac)).value
        # rx=bpf: the VID reaches the owner as it is, so the final eth_dst is the VID the switch computed
        assert _final_dst(out) == want, out


def _families(rnd: random.Random) -> dict[str, list[int]]:
    return {
        "sequential (perfdhcp)": [0x000C01020300 + i for i in range(64)],
        "stride 256": [0x02AB00000000 + (i << 8) for i in range(64)],
        "docker": [0x0242AC110000 + i for i in range(2, 66)],
        "random": [rnd.getrandbits(48) & ~(1 << 40) for _ in range(64)],
    }


def test_ovs_multipath_key_equals_mackey_for_clustered_macs(testbed, door):
    flow = _door_flows(testbed, door)[0]
    actions = flow.split("actions=", 1)[1]
    actions = re.sub(r",?goto_table:\d+", "", actions)   # a packet-out has no pipeline to go to
    port = int(re.search(r"in_port=(\d+)", flow).group(1))
    wrong = {}
    for family, macs in _families(random.Random(44)).items():
        for mac in macs:
            out = _trace("ofproto/trace-packet-out", "vfbs1", _dhcp_flow(port, mac), actions)
            got = _final_dst(out)
            want = codec.encode(door.id, mackey.key(mac)).value
            if got != want:
                wrong[codec.int_to_mac(mac)] = (family, hex(got), hex(want))
    assert not wrong, f"OVS and vfab.vid.mackey disagree on {len(wrong)} MACs: {dict(list(wrong.items())[:5])}"
