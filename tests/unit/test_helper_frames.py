"""mc-helper's af_packet ring for whole large requests (issue 43, item 4): control.af_packet_vdev.

DPDK 22.11's net_af_packet reads frame i of its ring at i * framesz and refuses a queue whose frame (less 32 B
of tpacket header) does not fit an rx mbuf's data room less its 128 B of headroom; the kernel wants blocks of
whole pages.  A first try with 65,424 B frames in 64 KB blocks received nothing past the first frame (frames
did not tile the blocks): these rules are checked here, the rest on the fabric
(tests/integration/test_mc_fabric.py::test_large_requests_follow_their_client_through_helpers_on_off_on).
"""

from __future__ import annotations

from vfab.services.memcached_helper import control

TPACKET_HDR, HEADROOM, PAGE = 32, 128, 4096


def ring(vdev: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in vdev.split(",")[1:])


def test_large_frames_tile_their_blocks_and_fit_the_rx_mbufs():
    vdev, extra = control.af_packet_vdev("vfmTh0", 1, large=True)
    r = ring(vdev)
    frame, block, count = int(r["framesz"]), int(r["blocksz"]), int(r["framecnt"])
    rx_buf = int(extra[extra.index("--rx-buf") + 1])
    assert frame % 16 == 0 and block % PAGE == 0 and block % frame == 0 and count % (block // frame) == 0
    assert frame - TPACKET_HDR <= rx_buf - HEADROOM and rx_buf <= 0xFFFF     # a 16-bit data room
    assert frame - 66 - 14 - 20 - 8 >= 60_000 + 300     # a 60 KB request and its command line fit one frame
    assert r["iface"] == "vfmTh0" and "qpairs" not in r


def test_small_frames_are_the_default_and_queues_are_passed():
    vdev, extra = control.af_packet_vdev("vfmTh0", 2)
    assert ring(vdev) == {"iface": "vfmTh0", "framecnt": "4096", "qpairs": "2"} and extra == ()
