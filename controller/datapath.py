"""When a table change has reached the datapath: the local ovs-vswitchd's revalidators, asked directly.

A committed bundle changes the OpenFlow tables at once, but packets keep
matching the flows cached in the datapath until a revalidator re-translates
each of them (about 5 µs per cached flow here, every bridge of the daemon in
one pass; TESTBED-NOTES.md).  ``revalidator/wait`` (ovs-vswitchd's control
socket, JSON-RPC) answers when the revalidators finish their next pass; a
pass that was already running when the tables changed may have translated
some flows before the change, so :meth:`Datapath.wait_pass` waits for two:
the second one started after the change, and once it ends every cached flow
matches the tables as committed.  The controller uses it to report
"applied" only once traffic follows the new tables (``Applied.datapath``),
and before turning the next switch of a hop-by-hop path (rx=bpf/promisc
endpoints; rx=ovs paths are consistent per packet without it).

Only a switch whose daemon runs on the controller's own host can be asked;
elsewhere ``available()`` says why not and the controller falls back to its
settle pause (and reports tables, not traffic).
"""

from __future__ import annotations

import json
import os
import socket
import time


class DatapathError(RuntimeError):
    """The daemon could not be asked or did not answer in time."""


class Datapath:
    def __init__(self, rundir: str = "/var/run/openvswitch", daemon: str = "ovs-vswitchd"):
        self.rundir, self.daemon = rundir, daemon
        self._id = 0

    def socket_path(self) -> str:
        pidfile = os.path.join(self.rundir, f"{self.daemon}.pid")
        try:
            with open(pidfile) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError) as exc:
            raise DatapathError(f"no local {self.daemon} ({pidfile}: {exc})") from None
        return os.path.join(self.rundir, f"{self.daemon}.{pid}.ctl")

    def available(self) -> str:
        """"" if the local daemon answers, else why not."""
        try:
            self.call("version", timeout=2.0)
            return ""
        except DatapathError as exc:
            return str(exc)

    def call(self, method: str, params: list | None = None, timeout: float = 5.0) -> str:
        """One unixctl command; its result text."""
        path = self.socket_path()
        self._id += 1
        req = json.dumps({"id": self._id, "method": method, "params": params or []}).encode()
        deadline = time.monotonic() + timeout
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(path)
                s.sendall(req)
                buf = b""
                dec = json.JSONDecoder()
                while True:
                    s.settimeout(max(0.001, deadline - time.monotonic()))
                    chunk = s.recv(65536)
                    if not chunk:
                        raise DatapathError(f"{self.daemon} closed the control connection during {method}")
                    buf += chunk
                    try:
                        reply, _ = dec.raw_decode(buf.decode())
                        break
                    except ValueError:
                        continue  # not all of it yet
        except socket.timeout:
            raise DatapathError(f"{self.daemon} did not answer {method} within {timeout:.1f} s") from None
        except OSError as exc:
            raise DatapathError(f"cannot reach {self.daemon} at {path}: {exc.strerror or exc}") from None
        if reply.get("error") is not None:
            raise DatapathError(f"{self.daemon} refused {method}: {reply['error']}")
        return str(reply.get("result") or "")

    def wait_pass(self, timeout: float = 5.0) -> float:
        """Return once a whole revalidation pass began and ended after this call; the seconds it took."""
        t0 = time.monotonic()
        for _ in range(2):
            left = timeout - (time.monotonic() - t0)
            if left <= 0:
                raise DatapathError(f"no complete revalidation pass of {self.daemon} within {timeout:.1f} s")
            self.call("revalidator/wait", timeout=left)
        return time.monotonic() - t0
