"""The local etcd compacts its history: load reports (a put a second per endpoint) must not fill its quota."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request

from vfab.testbed.etcd import LocalEtcd, free_port
from vfab.testbed.procs import wait_for
from vfab.vid.registry import Registry


def call(etcd: LocalEtcd, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"{etcd.client_url}/v3{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def test_the_default_keeps_an_hour_of_history():
    cmd = LocalEtcd("/nonexistent", 1, 2).command()
    at = cmd.index("--auto-compaction-retention")
    assert cmd[at + 1] == "1h" and cmd[cmd.index("--auto-compaction-mode") + 1] == "periodic"


def test_old_revisions_are_compacted_away_and_the_latest_value_stays(tmp_path):
    etcd = LocalEtcd(tmp_path / "etcd", free_port(), free_port(), history="1s")
    etcd.start(timeout=20)
    try:
        first = int(call(etcd, "/kv/put", {"key": b64("/vfab/v1/load/s/a"), "value": b64("1")})["header"]["revision"])
        for v in ("2", "3"):
            call(etcd, "/kv/put", {"key": b64("/vfab/v1/load/s/a"), "value": b64(v)})
        old = call(etcd, "/kv/range", {"key": b64("/vfab/v1/load/s/a"), "revision": first})
        assert base64.b64decode(old["kvs"][0]["value"]) == b"1"   # still there right after
        deadline, err = time.monotonic() + 20, ""
        while time.monotonic() < deadline and "compacted" not in err:
            call(etcd, "/kv/put", {"key": b64("/vfab/v1/load/s/a"), "value": b64("4")})  # the compactor needs revisions
            try:
                call(etcd, "/kv/range", {"key": b64("/vfab/v1/load/s/a"), "revision": first})
            except urllib.error.HTTPError as exc:
                err = exc.read().decode(errors="replace")
            time.sleep(0.5)
        assert "compacted" in err, "etcd kept revision %d past its 1 s of history" % first
        now = call(etcd, "/kv/range", {"key": b64("/vfab/v1/load/s/a")})
        assert base64.b64decode(now["kvs"][0]["value"]) == b"4"
    finally:
        etcd.stop()


def test_a_follower_of_a_quiet_prefix_reads_again_at_once_when_its_revision_is_compacted(tmp_path):
    """A quiet prefix's follower resumes its watch from its last revision; once etcd compacted past it
    (other keys kept moving), it reads the prefix again at once and says nothing: that is no failure."""
    etcd = LocalEtcd(tmp_path / "etcd", free_port(), free_port(), history="1s")
    etcd.start(timeout=20)
    reg, writer = Registry(etcd.endpoint), Registry(etcd.endpoint)
    resets, events, errors = [], [], []
    stop = threading.Event()
    follower = threading.Thread(target=reg.follow, args=("/vfab/v1/hosts/", lambda items, rev: resets.append(rev),
                                                          events.extend, stop),
                                kwargs={"idle": 0.3, "retry": 5.0, "on_error": lambda exc, first: errors.append(exc)},
                                daemon=True)
    try:
        follower.start()
        wait_for(lambda: resets, 10, "the follower's first read")
        deadline, i = time.monotonic() + 25, 0
        while len(resets) < 2 and not errors and time.monotonic() < deadline:
            writer.put("/vfab/v1/load/s/a", str(i))   # another prefix moves the revision on; compaction follows
            i += 1
            time.sleep(0.1)
        assert not errors, f"a compacted revision was reported as a failure: {errors}"
        assert len(resets) >= 2, "the follower never read its prefix again"
        writer.put("/vfab/v1/hosts/x", "1")
        wait_for(lambda: any(ev.key == "/vfab/v1/hosts/x" for ev in events), 2.0, "the event after the new read")
    finally:
        stop.set()
        follower.join(5)
        reg.close()
        writer.close()
        etcd.stop()

