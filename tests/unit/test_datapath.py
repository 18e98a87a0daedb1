"""controller/datapath.py against a stand-in for ovs-vswitchd's control socket (JSON-RPC over a Unix socket).

The real daemon is asked in tests/integration/test_busy_cutover.py; here: what is sent, how many passes
are waited for, and that every failure says what went wrong.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from vfab.controller.datapath import Datapath, DatapathError


class FakeDaemon(threading.Thread):
    """Answers unixctl requests: ``revalidator/wait`` after ``delay`` s, ``version``, anything else refused."""

    def __init__(self, rundir, delay=0.0, silent=False):
        super().__init__(daemon=True)
        self.pid = 4242
        (rundir / "ovs-vswitchd.pid").write_text(f"{self.pid}\n")
        self.path = str(rundir / f"ovs-vswitchd.{self.pid}.ctl")
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.path)
        self.srv.listen(8)
        self.delay, self.silent = delay, silent
        self.calls: list[str] = []

    def run(self):
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            with conn:
                req = json.loads(conn.recv(65536).decode())
                self.calls.append(req["method"])
                if self.silent:
                    time.sleep(1.0)
                    continue
                if req["method"] == "revalidator/wait":
                    time.sleep(self.delay)
                    reply = {"id": req["id"], "result": "", "error": None}
                elif req["method"] == "version":
                    reply = {"id": req["id"], "result": "ovs-vswitchd (Open vSwitch) 3.1.0\n", "error": None}
                else:
                    reply = {"id": req["id"], "result": None, "error": f"\"{req['method']}\" is not a valid command"}
                data = json.dumps(reply).encode()
                conn.sendall(data[:5])  # in two pieces: the reader must collect a whole reply
                conn.sendall(data[5:])

    def close(self):
        self.srv.close()


@pytest.fixture
def daemon(tmp_path):
    d = FakeDaemon(tmp_path, delay=0.05)
    d.start()
    yield d
    d.close()


def test_a_pass_is_two_revalidator_waits(daemon, tmp_path):
    dp = Datapath(str(tmp_path))
    assert dp.available() == ""
    took = dp.wait_pass(timeout=2.0)
    assert daemon.calls == ["version", "revalidator/wait", "revalidator/wait"]
    assert took >= 0.1  # both waits were waited for


def test_no_daemon_says_where_it_looked(tmp_path):
    why = Datapath(str(tmp_path)).available()
    assert "no local ovs-vswitchd" in why and str(tmp_path) in why
    with pytest.raises(DatapathError, match="ovs-vswitchd.pid"):
        Datapath(str(tmp_path)).wait_pass(1.0)


def test_a_stale_pid_file_is_a_clear_error(tmp_path):
    (tmp_path / "ovs-vswitchd.pid").write_text("999999\n")
    with pytest.raises(DatapathError, match="cannot reach ovs-vswitchd"):
        Datapath(str(tmp_path)).call("version")


def test_a_refused_command_and_a_silent_daemon(tmp_path):
    d = FakeDaemon(tmp_path, silent=False)
    d.start()
    try:
        with pytest.raises(DatapathError, match="refused no/such"):
            Datapath(str(tmp_path)).call("no/such")
    finally:
        d.close()
    os.unlink(d.path)
    s = FakeDaemon(tmp_path, silent=True)
    s.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(DatapathError, match="did not answer"):
            Datapath(str(tmp_path)).wait_pass(timeout=0.3)
        assert time.monotonic() - t0 < 0.9
    finally:
        s.close()
