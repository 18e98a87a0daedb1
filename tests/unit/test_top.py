"""``vfab top``: one frame from a real etcd (``--once``), and the frame's parts from records built here."""

from __future__ import annotations

from click.testing import CliRunner

from vfab.cli import cmd_top, topview
from vfab.cli.main import cli
from vfab.vid.ranges import Range
from vfab.vid.registry import schema


def _items(recs: dict[str, str], mod: int = 5) -> dict[str, tuple[bytes, int]]:
    return {k: (v.encode(), mod) for k, v in recs.items()}


def test_bar():
    assert topview.bar(0, 0, 10) == "[..........]   0%"
    assert topview.bar(5, 10, 10) == "[#####.....]  50%"
    assert topview.bar(12, 10, 10) == "[##########] 100%"


def test_frame_shows_switches_ranges_ops_helpers_and_decisions():
    now = 1_000_000.0
    recs = {
        schema.service_key("kvs"): schema.Service(name="kvs", id=1, kind="elastic-kvs").to_json(),
        schema.endpoint_key("kvs", "a"): schema.Endpoint(service="kvs", name="a", mac="02:00:00:00:00:01").to_json(),
        schema.range_key("kvs", 0): schema.RangeRec(lo=0, hi=0x7FFFFF, owner="a", mirrors=["b"]).to_json(),
        schema.range_key("kvs", 0x800000): schema.RangeRec(lo=0x800000, hi=0xFFFFFF, owner="b").to_json(),
        schema.load_key("kvs", "a"): schema.Load(at=now, ranges=[[0, 0x7FFFFF, 1234, 567.0]]).to_json(),
        schema.switch_key(1): schema.Switch(dpid=1, name="vfs1").to_json(),
        schema.applied_key(1): schema.Applied(dpid=1, revision=3, flows=40, groups=1, at=now - 1).to_json(),
        schema.op_key("kvs", "a.1"): schema.OpRec(op="split", source="a", peer="c", ranges=[[0, 0x3FFFFF]],
                                                  phase="copy", done=300, total=1200, started=now - 2,
                                                  updated=now).to_json(),
        schema.op_key("kvs", "a.0"): schema.OpRec(op="move", source="a", peer="c", ranges=[[0, 1]], phase="done",
                                                  started=now - 100, updated=now - 90).to_json(),
        schema.helper_key("mc", "h1"): schema.HelperStatus(at=now, stats={"batch_S_bytes": 1400, "batch_T_ns": 20000,
                                                                         "b_cmds": 10, "b_keys": 320}).to_json(),
        schema.balancer_key("kvs"): schema.BalancerStatus(at=now - 1, runner="bal@h", decisions=[
            {"at": now - 5, "action": "split", "ranges": [[0, 0x7FFFFF]], "peer": "c", "result": "running",
             "reason": "load 900/s > 500/s"}]).to_json(),
        "/vfab/v1/ranges/kvs/zz": "not json",   # skipped, not fatal
    }
    items = _items(recs)
    items[schema.range_key("kvs", 0)] = (items[schema.range_key("kvs", 0)][0], 9)   # newest state revision
    text = "\n".join(topview.frame(items, 12, now=now, where="127.0.0.1:2379"))
    assert "revision 12" in text and "state revision 9" in text
    assert "0000000000000001 vfs1" in text and "BEHIND by 6 revision(s)" in text and "flows 40" in text
    assert "000000-7fffff  a              b(down)" in text and "1234" in text and "567" in text
    assert "800000-ffffff  b (down)" in text
    assert "split a -> c 000000-3fffff" in text and "[######..................]  25%" in text
    assert "300/1200 records  copy" in text
    assert "move a -> c" not in text           # finished long ago: no longer shown
    assert "S 1400 B  T 20 us  batches 10  keys/batch 32.0" in text
    assert "split       000000-7fffff -> c  running  (load 900/s > 500/s)" in text


def test_top_once_against_etcd(registry):
    registry.create_service("echo")
    registry.announce(schema.Endpoint(service="echo", name="s1", mac="00:00:00:00:00:01"), ttl=30)
    registry.assign("echo", Range(0, 0x7FFFFF), "s1")
    res = CliRunner().invoke(cli, ["--etcd", registry.endpoint, "top", "--once"])
    assert res.exit_code == 0, res.output
    assert "echo (no kind, id 1)  endpoints: s1" in res.output
    assert "000000-7fffff  s1" in res.output and "800000-ffffff  -" in res.output
    assert "none running" in res.output


def test_top_once_without_etcd_says_so():
    res = CliRunner().invoke(cli, ["--etcd", "127.0.0.1:1", "top", "--once"])
    assert res.exit_code == 1 and "unreachable" in res.output


def test_fit_cuts_to_the_terminal():
    lines = [f"line {i} " + "x" * 50 for i in range(10)]
    out = cmd_top.fit(lines, 20, 4).split("\r\n")
    assert len(out) == 4 and all(len(x) <= 20 for x in out) and out[-1].startswith("... 7 more")
