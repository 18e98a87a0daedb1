"""How a testbed process ends and what it leaves: signal unwinding, process identity, run records.

The real thing (OVS bridges, veths, Mininet) is in
tests/integration/test_testbed_kill.py; these cover the parts without a fabric:
SIGTERM/SIGHUP unwinding like SIGINT in a real process, a teardown held to its
end, PID + start-time identity, and sweeping a private record directory.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from vfab.testbed import leftovers

UNWIND = """
import signal, sys, time
from vfab.testbed.procs import unwind_on_signals
if "--nohup" in sys.argv:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
unwind_on_signals()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    open(sys.argv[1], "w").write("unwound")
"""

SHIELD = """
import time
from vfab.testbed.procs import shielded, unwind_on_signals
unwind_on_signals()
with shielded():
    print("in", flush=True)
    time.sleep(1.0)
    print("out", flush=True)
print("after", flush=True)
"""


def default_signals() -> None:
    """In the child: SIGINT, SIGHUP and SIGTERM at their defaults, as from an operator's shell.  A run started
    under nohup or as a background job of a script inherits SIGHUP or SIGINT ignored, and an ignored signal is
    left alone by design (unwind_on_signals): these tests are about the usual case."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def spawn(script: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=default_signals)
    assert proc.stdout.readline().strip() in ("ready", "in")
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_signals_unwind_like_sigint(tmp_path, sig):
    mark = tmp_path / "mark"
    proc = spawn(UNWIND, str(mark))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    assert mark.read_text() == "unwound", f"finally did not run on {sig.name}: {err}"
    assert "KeyboardInterrupt" in err or f"Interrupted: {sig.name}" in err, err
    assert proc.returncode != 0


def test_an_ignored_sighup_stays_ignored(tmp_path):
    """Under nohup (SIGHUP ignored) the run goes on; SIGTERM still unwinds it."""
    mark = tmp_path / "mark"
    proc = spawn(UNWIND, str(mark), "--nohup")
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert proc.poll() is None, "SIGHUP ended a process that ignores it"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert mark.read_text() == "unwound" and "Interrupted: SIGTERM" in err, err


def test_a_teardown_is_held_to_its_end_then_the_signal_acts():
    proc = spawn(SHIELD)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)       # a second, impatient signal does not cut the teardown either
    out, err = proc.communicate(timeout=20)
    assert "out" in out.split(), f"the shielded block was cut short: {out!r} {err}"
    assert "after" not in out.split(), "the held signal was dropped"
    assert "Interrupted: SIGTERM" in err, err


def test_process_identity_is_pid_and_start_time():
    me = leftovers.identity(os.getpid(), "me")
    assert leftovers.same_process(me) and leftovers.same_process(me, leftovers.boot_id())
    assert not leftovers.same_process(dict(me, start=me["start"] - 1)), "a reused PID passed for the process"
    assert not leftovers.same_process(me, "another-boot")
    child = subprocess.Popen(["sleep", "30"])
    ident = leftovers.identity(child.pid, "child")
    assert leftovers.same_process(ident)
    child.kill()
    time.sleep(0.3)                                 # not reaped yet: a zombie
    assert not leftovers.same_process(ident)
    child.wait()
    assert not leftovers.same_process(ident)


def fake_run(state_dir, owner: subprocess.Popen, **data) -> str:
    path = os.path.join(state_dir, f"{owner.pid}-unit.json")
    rec = leftovers.RunRecord(path, {"version": 1, "boot_id": leftovers.boot_id(),
                                     "owner": leftovers.identity(owner.pid, "owner"), "created": "unit",
                                     "procs": [], "bridges": [], "nodes": [], "links": [], "netns": [],
                                     "dirs": [], "ovs": None, **data})
    rec.write()
    return path


def test_sweep_leaves_a_live_run_and_clears_a_dead_one(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="vfab.testbed.leftovers")
    state = str(tmp_path / "state")
    os.makedirs(state)
    owner, child, stranger = (subprocess.Popen(["sleep", "60"]) for _ in range(3))
    made = tmp_path / "vfab-run"
    made.mkdir()
    (made / "etcd").mkdir()
    wrong = dict(leftovers.identity(stranger.pid, "reused pid"))
    wrong["start"] -= 1                             # the recorded process is gone; its PID now is someone else's
    try:
        path = fake_run(state, owner, procs=[leftovers.identity(child.pid, "server"), wrong], dirs=[str(made)])
        swept = leftovers.sweep(state)
        assert swept.live == [path] and not swept.records and not swept.removed
        assert os.path.exists(path) and child.poll() is None and made.is_dir()

        owner.kill()
        owner.wait()
        swept = leftovers.sweep(state)
        assert swept.records == [path] and not os.path.exists(path)
        assert child.wait(10) == -signal.SIGTERM, "the recorded process was not stopped"
        assert stranger.poll() is None, "a process with a reused PID was touched"
        assert not made.exists()
        assert len(swept.removed) == 2, swept.removed
        assert f"removed process {child.pid} (server" in caplog.text
        assert f"removed directory {made}" in caplog.text
        assert str(stranger.pid) not in caplog.text
    finally:
        for p in (owner, child, stranger):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_after_a_reboot_recorded_pids_are_not_processes(tmp_path):
    state = str(tmp_path / "state")
    os.makedirs(state)
    owner, child = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    try:
        path = fake_run(state, owner, procs=[leftovers.identity(child.pid, "server")])
        with open(path) as fh:
            data = json.load(fh)
        data["boot_id"] = "an-earlier-boot"
        with open(path, "w") as fh:
            json.dump(data, fh)
        swept = leftovers.sweep(state)
        assert swept.records == [path] and not swept.removed
        assert child.poll() is None, "a process was stopped on the word of a record from another boot"
    finally:
        for p in (owner, child):
            p.kill()
            p.wait()


def test_an_unreadable_record_is_left_alone(tmp_path, caplog):
    state = tmp_path / "state"
    state.mkdir()
    (state / "1-bad.json").write_text("{not json")
    swept = leftovers.sweep(str(state))
    assert not swept.records and (state / "1-bad.json").exists()
    assert "unreadable" in caplog.text


def test_the_record_is_written_before_each_resource(tmp_path):
    rec = leftovers.RunRecord.create(str(tmp_path), topo="single,1")
    assert json.load(open(rec.path))["owner"]["pid"] == os.getpid()
    rec.add("bridges", "vfbs1")
    rec.add_proc(os.getpid(), "me")
    on_disk = json.load(open(rec.path))
    assert on_disk["bridges"] == ["vfbs1"] and on_disk["procs"][0]["pid"] == os.getpid()
    rec.drop_proc(os.getpid())
    assert json.load(open(rec.path))["procs"] == []
    rec.remove()
    assert os.listdir(tmp_path) == []


def test_several_processes_recorded_and_dropped_in_one_write(tmp_path):
    """A farm's clients go into the record together; each one is identified (start time), and dropping some
    keeps the others."""
    rec = leftovers.RunRecord.create(str(tmp_path), topo="single,1")
    kids = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    try:
        rec.add_procs([(k.pid, f"k{i}") for i, k in enumerate(kids)])
        on_disk = json.load(open(rec.path))["procs"]
        assert [p["name"] for p in on_disk] == ["k0", "k1", "k2"]
        assert all(leftovers.same_process(p) for p in on_disk)
        rec.drop_procs([kids[0].pid, kids[2].pid])
        assert [p["pid"] for p in json.load(open(rec.path))["procs"]] == [kids[1].pid]
    finally:
        for k in kids:
            k.kill()
            k.wait()
    rec.remove()


def test_a_recorded_dir_with_a_mount_inside_is_not_deleted(tmp_path, caplog):
    if os.geteuid() != 0:
        pytest.fail("this test needs root (mount)")
    state = tmp_path / "state"
    state.mkdir()
    made = tmp_path / "vfab-run"
    disk = made / "vfx-disk"
    disk.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    owner = subprocess.Popen(["sleep", "60"])
    try:
        (disk / "precious").write_text("x")
        path = fake_run(str(state), owner, dirs=[str(made)])
        owner.kill()
        owner.wait()
        swept = leftovers.sweep(str(state))
        assert swept.records == [path] and not swept.removed
        assert (disk / "precious").exists(), "the sweep deleted through a mount point"
        assert "has mounts in it" in caplog.text
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


FORKER = """
import multiprocessing as mp, os, sys, time
from vfab.testbed import lock
lock.LOCK_FILE = sys.argv[1]
lock.acquire_lock(wait=5)
child = mp.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
child.start()
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_forked_child_does_not_keep_the_testbed_lock(tmp_path):
    """A benchmark's multiprocessing child outliving a SIGKILLed parent must not block the next testbed."""
    import fcntl

    lock = str(tmp_path / "testbed.lock")
    parent = subprocess.Popen([sys.executable, "-c", FORKER, lock], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        with open(lock, "w") as fh:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)     # held by the parent
            parent.kill()
            parent.wait()
            assert leftovers.start_time(child) is not None, "the child should outlive its parent here"
            # free although the child lives, once the child ran its at-fork hook (on a loaded machine it may not
            # have been scheduled yet when its parent died; a next testbed waits for the lock anyway)
            deadline = time.monotonic() + 10
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            assert leftovers.start_time(child) is not None, "the child should still live: it slept 60 s"
    finally:
        if leftovers.start_time(child) is not None:
            os.kill(child, signal.SIGKILL)
