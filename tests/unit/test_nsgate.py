"""testbed.nsgate: processes held in their namespaces until the release, then started together."""
from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from vfab.testbed.nsgate import HeldStart
from vfab.testbed.procs import wait_for


@pytest.fixture
def namespaces():
    if os.geteuid() != 0:
        pytest.fail("needs root (network namespaces)")
    names = [f"vfx{uuid.uuid4().hex[:6]}" for _ in range(3)]
    subprocess.run(["ip", "-batch", "-"], input="".join(f"netns add {n}\n" for n in names), text=True, check=True)
    try:
        yield [f"/run/netns/{n}" for n in names]
    finally:
        subprocess.run(["ip", "-batch", "-"], input="".join(f"netns del {n}\n" for n in names), text=True, check=True)


def _netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def test_held_processes_wait_in_their_namespaces_and_run_only_after_the_release(namespaces, tmp_path):
    marks = [tmp_path / f"ran{i}" for i in range(len(namespaces))]
    # each records the namespace it runs in and exits with its own code
    gate = HeldStart([(ns, ["sh", "-c", f"readlink /proc/self/ns/net > {m}; exit {i + 3}"])
                      for i, (ns, m) in enumerate(zip(namespaces, marks))])
    try:
        assert len(gate.procs) == 3
        for p, ns in zip(gate.procs, namespaces):
            assert p.poll() is None
            assert _netns_inode(p.pid) == os.stat(ns).st_ino, "entered before the release"
            assert os.getsid(p.pid) == p.pid, "a session (and process group) of its own"
            assert open(f"/proc/{p.pid}/comm").read().strip() == "vfab-nsgate", "exec'd before the release"
        assert not any(m.exists() for m in marks)
        gate.release()
        codes = [p.wait(10) for p in gate.procs]
    finally:
        gate.abandon()
    assert codes == [3, 4, 5]
    for m, ns in zip(marks, namespaces):
        assert m.read_text().strip() == f"net:[{os.stat(ns).st_ino}]"


def test_abandoned_before_the_release_nothing_runs(namespaces, tmp_path):
    marks = [tmp_path / f"ran{i}" for i in range(len(namespaces))]
    gate = HeldStart([(ns, ["sh", "-c", f"touch {m}"]) for ns, m in zip(namespaces, marks)])
    gate.abandon()
    assert gate.proc.returncode == 0
    assert [p.poll() for p in gate.procs] == [0, 0, 0], "each held process ended when abandoned"
    assert not any(m.exists() for m in marks), "an abandoned process ran its command"


def test_a_signal_and_a_bad_namespace_or_command_show_in_the_exit_codes(namespaces, tmp_path):
    with open(tmp_path / "err", "w") as err:
        gate = HeldStart([(namespaces[0], ["sleep", "30"]), (str(tmp_path / "no-such-netns"), ["true"]),
                          (namespaces[1], ["/nonexistent/vfab-program"])], stderr=err)
    try:
        gate.release()
        wait_for(lambda: open(f"/proc/{gate.procs[0].pid}/comm").read().strip() == "sleep", 10, "sleep started")
        os.killpg(gate.procs[0].pid, 9)
        assert [p.wait(10) for p in gate.procs] == [-9, 126, 127]
    finally:
        gate.abandon()
    err = (tmp_path / "err").read_text()
    assert "no-such-netns" in err and "exec /nonexistent/vfab-program" in err


def test_a_field_with_a_tab_or_newline_or_an_empty_command_is_refused(namespaces):
    for spec in [(namespaces[0], ["echo", "a\tb"]), (namespaces[0], ["echo\n"]), (namespaces[0], [])]:
        with pytest.raises(ValueError, match="no empty field, tab or newline"):
            HeldStart([spec])
