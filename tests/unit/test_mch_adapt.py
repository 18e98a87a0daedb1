"""The helper's adaptive batching (PostMan Algorithm 1 with bounds) and its option checking.

``mch_adapt_test`` drives services/memcached-helper/dpdk/mch_adapt.c (built by the core's Makefile, with and
without sanitizers, through test_mc_proto.core_build); ``mc-helper -- --check`` validates options before DPDK
starts, so the option table is tested without a port.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.unit.test_mc_proto import CORE_DIR, LineDriver


class Adapt(LineDriver):
    def init(self, *v: int) -> tuple[int, int]:
        out = self.cmd("init " + " ".join(map(str, v)))
        return int(out[1]), int(out[3])

    def update(self, s: int, t: int) -> tuple[int, int]:
        out = self.cmd(f"update {s} {t}")
        return int(out[1]), int(out[3])


adapt = Adapt.fixture("mch_adapt_test")


def test_size_follows_batches_that_differ_by_more_than_a_quarter(adapt):
    assert adapt.init(1500, 1500, 65536, 100, 10, 1000) == (1500, 100)
    assert adapt.update(1800, 100) == (1500, 100)   # within 1.25 S: kept
    assert adapt.update(1900, 100) == (1900, 100)   # above 1.25 S: S <- s
    assert adapt.update(1430, 100) == (1900, 100)   # below 0.75 S but under the 1500-byte floor: kept
    assert adapt.update(1424, 100) == (1900, 100)
    assert adapt.init(4000, 1500, 65536, 100, 10, 1000) == (4000, 100)
    assert adapt.update(2999, 100) == (2999, 100)   # below 0.75 S and >= 1500: S <- s
    assert adapt.update(3748, 100) == (2999, 100)   # 1.2497 S: kept
    assert adapt.update(3749, 100) == (3749, 100)   # 1.2501 S: moved


def test_interval_follows_batches_that_differ_by_more_than_half(adapt):
    assert adapt.init(1500, 1500, 65536, 100, 10, 1000) == (1500, 100)
    assert adapt.update(1500, 149) == (1500, 100)   # within 1.5 T
    assert adapt.update(1500, 151) == (1500, 151)   # above: T <- t
    assert adapt.update(1500, 76) == (1500, 151)    # 0.503 T: kept
    assert adapt.update(1500, 75) == (1500, 75)     # below 0.5 T: T <- t
    assert adapt.update(1500, 9) == (1500, 75)      # under the 10-tick floor: never taken
    assert adapt.update(1500, 10) == (1500, 10)


def test_upper_bounds_cap_what_one_idle_period_or_burst_can_do(adapt):
    assert adapt.init(1500, 1500, 8000, 50, 10, 200) == (1500, 50)
    assert adapt.update(1_000_000, 10_000_000) == (8000, 200)   # a long idle gap and a huge burst: capped
    assert adapt.update(1500, 200) == (1500, 200)
    # initial values outside the bounds are clamped, crossed bounds put in order
    assert adapt.init(10, 1500, 8000, 5, 10, 200) == (1500, 10)
    assert adapt.init(99999, 1500, 1000, 999, 10, 5) == (1500, 10)


def test_due_when_either_condition_holds(adapt):
    adapt.init(2000, 1500, 65536, 100, 10, 1000)
    assert adapt.cmd("due 1999 99") == ["DUE", "0"]
    assert adapt.cmd("due 2000 0") == ["DUE", "1"]     # condition 2: size reached S
    assert adapt.cmd("due 10 100") == ["DUE", "1"]     # condition 1: T passed since the last send


def test_load_pattern_moves_t_down_under_load_and_up_when_calm(adapt):
    """A busy period (batches reaching S every 20 ticks) pulls T down; a calm one (sparse batches) pushes it
    up to the bound; the same sequence run twice gives the same values (no hidden state)."""
    def run() -> list[tuple[int, int]]:
        trace = [adapt.init(1500, 1500, 65536, 100, 10, 400)]
        trace += [adapt.update(1600, 20) for _ in range(5)]      # heavy: S reached after 20 ticks
        trace += [adapt.update(2600, 15) for _ in range(3)]      # heavier: bigger bursts
        trace += [adapt.update(40, 900) for _ in range(3)]       # calm: one small get per long gap
        return trace
    first = run()
    assert first == run()
    assert first[1] == (1500, 20)
    assert first[6] == (2600, 20)          # 15 >= 0.5 * 20: T kept, S grew
    assert first[-1] == (2600, 400)        # calm: T at its bound; S keeps its last large value


def test_histogram_buckets_are_powers_of_two(adapt):
    got = {k: adapt.cmd(f"bucket {k}")[1:] for k in (1, 2, 3, 4, 7, 8, 255, 256, 1000)}
    assert got == {1: ["0", "1"], 2: ["1", "2"], 3: ["1", "2"], 4: ["2", "4"], 7: ["2", "4"], 8: ["3", "8"],
                   255: ["7", "128"], 256: ["8", "256"], 1000: ["8", "256"]}


# ---------------------------------------------------------------- option table of mc-helper


@functools.cache
def helper_binary(sanitize: bool = False) -> Path:
    """Build mc-helper (meson + ninja against Debian's libdpdk-dev) once per session, into a temp dir;
    ``sanitize``: with AddressSanitizer and UBSan."""
    out = Path(tempfile.mkdtemp(prefix="vfab-mch-"))
    atexit.register(shutil.rmtree, out, True)
    res = subprocess.run(["make", "-C", str(CORE_DIR), f"BUILD={out}", f"SANITIZE={int(sanitize)}", "helper"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"mc-helper build failed (scripts/bootstrap.sh installs meson and libdpdk-dev):\n" \
                                f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert "warning" not in res.stdout.lower() + res.stderr.lower(), res.stdout + res.stderr
    return out / "meson" / "mc-helper"


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helper_binary()), "--", "--check", *args], capture_output=True, text=True, timeout=30)


def test_helper_builds_and_accepts_a_full_configuration():
    res = check("--service", "10.0.0.1", "--memcached", "10.1.0.1:11311", "--conns", "4", "--s-init", "3000",
                "--s-max", "16000", "--t-init", "20", "--t-max", "500", "--idle-us", "50", "--stats-file",
                "/tmp/x.stats", "--any-mac", "--stall-ms", "30", "--order-hold-us", "500")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("config ok: service 10.0.0.1:11211 memcached 10.1.0.1:11311 conns 4 S 3000 "
                                 "[1500, 16000] B T 20 [10, 500] us idle 50..2000 us stall 30 ms order hold 500 us"), res.stdout
    res = check("--service=10.0.0.1:12000")
    assert "memcached 10.0.0.1:12000" in res.stdout      # the TCP leg defaults to the service address


@pytest.mark.parametrize("args, message", [
    ((), "--service IP[:PORT] is required"),
    (("--service", "10.0.0.1", "--bogus", "1"), "unknown option '--bogus'"),
    (("--service", "10.0.0.300"), "is not an IPv4 address"),
    (("--service", "10.0.0.1:0"), "port must be 1..65535"),
    (("--service", "10.0.0.1", "--conns", "0"), "--conns 0: expected an integer in 1..64"),
    (("--service", "10.0.0.1", "--conns", "-3"), "expected an integer in 1..64"),
    (("--service", "10.0.0.1", "--t-min", "50", "--t-max", "20", "--t-init", "30"), "--t-min 50 is above --t-max 20"),
    (("--service", "10.0.0.1", "--s-init", "1000"), "--s-init 1000 is outside --s-min..--s-max (1500..32768)"),
    (("--service", "10.0.0.1", "--any-mac=1"), "--any-mac takes no value"),
    (("--service", "10.0.0.1", "--stats-file"), "--stats-file needs a value"),
    (("--service", "10.0.0.1", "stray"), "unexpected argument 'stray'"),
    (("--service", "10.0.0.1", "--stall-ms", "2"), "--stall-ms 2: expected an integer in 5..60000"),
    (("--service", "10.0.0.1", "--order-hold-us", "200000"), "--order-hold-us 200000: expected an integer in 0..100000"),
])
def test_helper_rejects_bad_options_naming_the_limit(args, message):
    res = check(*args)
    assert res.returncode == 2
    assert message in res.stderr, res.stderr
