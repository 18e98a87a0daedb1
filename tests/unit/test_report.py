"""``make report`` (bench/report.py): the newest results per benchmark, PNG plots with data, one HTML page."""

from __future__ import annotations

import json
import struct

from bench import report


def _write(folder, name, results, at="2026-12-07T05:00:00Z", smoke=True, params=None):
    path = folder / f"{name}{'-smoke' if smoke else ''}.json"
    path.write_text(json.dumps({"benchmark": name, "at": at, "params": params or {"smoke": smoke},
                                "results": results}))
    return path


def _png_size(path) -> tuple[int, int]:
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is no PNG"
    return struct.unpack(">II", raw[16:24])


def test_report_plots_and_tables(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    side = {"req_per_s": 3000.0, "median_ms": 0.4}
    _write(res, "kvs_throughput", {"points": [{"clients": c, "elastic": dict(side, req_per_s=1000.0 * c),
                                              "standard": side} for c in (1, 4, 16)]})
    _write(res, "kvs_throughput", {"points": []}, at="2026-12-01T00:00:00Z", smoke=False)   # older: not shown
    _write(res, "kvs_ops", {"configs": [{"keys": 200, "placement": "local", "ops": [
        {"op": "split", "timings": {"begin_s": 0.003, "copy_s": 0.01, "flip_s": 0.008, "total_s": 0.03}}]}]})
    _write(res, "reroute", {"by_clients": {"1": {"first": {"median_ms": 5.0, "p99_ms": 9.0}}}})
    _write(res, "metrics_cost", {"rounds": [{"with": {"req_per_s": 990.0}, "without": {"req_per_s": 1000.0},
                                             "ratio": 0.99}], "median_ratio": 0.99})
    _write(res, "sdhcp_lease", {"median": {"leases_per_s": 812.5, "ok": True}})          # no plotter: a table
    _write(res, "flow_install", {"points": "not what a plotter wants"})
    (res / "reroute-smoke-samples.json").write_text("[1, 2, 3]")                           # not a results file
    page = report.build(str(res), str(tmp_path / "out"))
    text = open(page).read()
    for name in ("kvs_throughput", "kvs_ops", "reroute", "metrics_cost"):
        w, h = _png_size(tmp_path / "out" / f"{name}.png")
        assert w > 300 and h > 200
        assert f'<img src="{name}.png"' in text
        assert (tmp_path / "out" / f"{name}.png").stat().st_size > 5000   # axes, bars or lines: not empty
    assert "<code>points[2].elastic.req_per_s</code></td><td>16000" in text   # the newer of the two files
    assert "<code>median.leases_per_s</code></td><td>812.5" in text and "median.ok" not in text
    assert "sdhcp_lease.png" not in text
    assert len(list((tmp_path / "out").glob("*.png"))) == 4


def test_a_plotter_meeting_another_shape_says_so(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    _write(res, "metrics_cost", {"rounds": [{"with": {}}]})
    text = open(report.build(str(res), str(tmp_path / "out"))).read()
    assert "no plot: the results file has another shape" in text
