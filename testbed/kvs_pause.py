"""A mirrored elastic-KVS owner paused with writes in flight (issue 42), repeated, checked with the history checker.

One repetition, on a Testbed (topology line,2,3: owner and mirror on vfh1/vfh5,
two clients on vfh2/vfh3)::

    the owner has a mirror; client B puts the hot key (acknowledged)
    SIGSTOP the owner
    client A puts the hot key: every attempt waits in the stopped owner's socket
        (the mirror ignores its copies), until the owner's lease expires, the
        mirror takes the range over and answers A's next attempt
    client B puts the hot key WRITES more times (all acknowledged; > 16, the
        size of the old memory of request ids per key)
    SIGCONT the owner: it registers again and deals with what it held
        (before issue 42: forwarded it to the new owner, which applied A's PUT
        again over B's newer ones)
    client A sends its PUT once more (a late copy of it): answered from its completion record
    client B reads the hot key for READ_FOR s
    the new owner mirrors to the old one: roles swap for the next repetition

Every operation is recorded as a history row and the lot (with a final read-back)
goes through ``history.check``.  The old owner's STATS say how many requests it
held while fenced and what became of them.  Only APIs that every revision of the
project has are used, so the same module runs against an older checkout (to show the
bug it fixed): ``python testbed/kvs_pause.py`` with that checkout's interpreter.
"""

from __future__ import annotations

import os
import signal
import time

from vfab.services.elastic_kvs.client import KvsClient
from vfab.services.elastic_kvs.proto import Op
from vfab.testbed import history, kvs
from vfab.testbed.fabric import Testbed
from vfab.testbed.procs import wait_for
from vfab.vid.ranges import Range
from vfab.vid.state import ctl as statectl

FULL = Range(0, 0xFFFFFF)
HOT = "hot"
WRITES = 24        # acknowledged writes of the hot key while the old owner is stopped (> 16)
READ_FOR = 0.3     # s the hot key is read after the old owner dealt with what it held
TTL = 1            # s: the servers' lease (the testbed's etcd allows 1 s); a takeover comes ~1-2 s after SIGSTOP


def _op(cli: KvsClient, name: str, op: Op, key: str, value: str = "") -> list:
    """Run one operation to its end; its history row [client, op, key, value, invoke, respond, status, version]."""
    p = cli.submit(op, key.encode(), value.encode())
    while p.reply is None and not p.error:
        cli.poll(0.05)
    return _row(name, p)


def _row(name: str, p) -> list:
    status = p.reply.status.name if p.reply is not None else "TIMEOUT"
    value = p.value.decode() if p.op is Op.PUT else None
    if p.op is Op.GET and p.reply is not None and status == "OK":
        value = p.reply.body.decode().split(".")[0]
    return [name, p.op.name, p.key.decode(), value, p.submitted, p.finished or time.monotonic(), status,
            p.reply.version if p.reply is not None else 0]


def _stats(tb: Testbed, service: str, name: str) -> dict:
    return statectl.command(tb.registry, service, name, "STATS", {}).body.get("counters", {})


def _owner(tb: Testbed, service: str) -> str:
    recs = [r for r, _ in tb.registry.ranges(service)]
    return recs[0].owner if len(recs) == 1 else ""


def run(tb: Testbed, service: str, reps: int, writes: int = WRITES, say=print) -> dict:
    """``reps`` repetitions on ``tb`` (service created here); the checker's report plus what each one saw."""
    tb.registry.create_service(service)
    servers = {"a": kvs.start_server(tb, "vfh1", "a", service, "0-0xffffff", ttl=TTL),
               "c": kvs.start_server(tb, "vfh5", "c", service, ttl=TTL)}
    tb.wait_revision(tb.registry.state_revision())
    rows: list[list] = []
    reps_seen = []
    writer, other = kvs.client(tb, "vfh2", service, timeout=0.3), kvs.client(tb, "vfh3", service, timeout=0.3)
    owner, mirror = "a", "c"
    try:
        for rep in range(reps):
            op = statectl.wait(tb.registry, service, statectl.mirror(tb.registry, service, owner, mirror).op, 60)
            if op.phase != "done":
                raise RuntimeError(f"repetition {rep}: mirroring {owner} to {mirror} ended {op.phase}: {op.error}")
            rows.append(_op(other, "B", Op.PUT, HOT, f"b{rep}-base"))
            before = _stats(tb, service, owner)
            pid = servers[owner].pid
            t_stop = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            try:
                p = writer.submit(Op.PUT, HOT.encode(), f"a{rep}-paused".encode())
                wait_for(lambda: _owner(tb, service) == mirror, 15, f"{mirror} to take the range over")
                took = time.monotonic() - t_stop
                while p.reply is None and not p.error:
                    writer.poll(0.05)
                a_row, attempts = _row("A", p), p.attempts
                rows.append(a_row)
                for i in range(writes):
                    rows.append(_op(other, "B", Op.PUT, HOT, f"b{rep}-{i}"))
            finally:
                os.kill(pid, signal.SIGCONT)
            held = {}

            def settled() -> bool:
                """The old owner is back and has dealt with every request it held while fenced."""
                if owner not in [e.name for e in tb.registry.endpoints(service)]:
                    return False
                now = _stats(tb, service, owner)
                held.update({k: now.get(k, 0) - before.get(k, 0)
                             for k in ("fenced", "forwarded", "fenced_dropped")})
                return held["forwarded"] + held["fenced_dropped"] >= max(1, held["fenced"])

            try:
                wait_for(settled, 15, f"{owner} to register again and deal with the requests it held")
            except TimeoutError as exc:
                raise TimeoutError(f"{exc} (its counters since SIGSTOP: {held or 'not registered again'}; log "
                                   f"{servers[owner].logpath})") from None
            # A's PUT once more, as a late copy of it would still arrive (a retry that waited in the network, a
            # forward): the completion record that moved to the new owner must answer it, with its first version
            p.reply, p.attempts = None, 0
            writer.inflight[p.reqid] = p
            writer._send(p)
            while p.reply is None and not p.error:
                writer.poll(0.05)
            late = (p.reply.status.name, p.reply.version) if p.reply is not None else ("TIMEOUT", 0)
            t_read = time.monotonic() + READ_FOR
            while time.monotonic() < t_read:
                rows.append(_op(other, "B", Op.GET, HOT))
            seen = {"rep": rep, "owner": owner, "takeover_s": round(took, 2), "a_attempts": attempts,
                    "a_status": a_row[6], "a_version": a_row[7], "late_copy": late, "held": dict(held),
                    "last_read": rows[-1][3]}
            reps_seen.append(seen)
            say(f"  repetition {rep + 1}/{reps}: {owner} stopped, {mirror} took over after {took:.2f} s; A's put "
                f"{seen['a_status']} after {attempts} attempt(s); {owner} held {held['fenced']} request(s): "
                f"forwarded {held['forwarded']}, dropped {held['fenced_dropped']}; A's put sent again: {late[0]} "
                f"version {late[1]} (first: {a_row[7]}); read {seen['last_read']!r}")
            owner, mirror = mirror, owner
        at = time.monotonic()
        final = kvs.read_back(tb, "vfh3", service, [HOT])
    finally:
        writer.close()
        other.close()
        for proc in servers.values():
            if proc.alive():
                os.kill(proc.pid, signal.SIGCONT)
            tb.sup.stop(proc)
    report = history.check(rows, final, at)
    raised = [n for n, p in servers.items() if "Traceback" in open(p.logpath).read()]
    return {"reps": reps_seen, "report": report, "final": final, "raised": raised}


def main() -> int:
    """Run the scenario on a fresh testbed: ``python testbed/kvs_pause.py [REPS]`` (root); exit 1 on violations."""
    import sys

    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with Testbed("line,2,3") as tb:
        out = run(tb, "kvs-pause", reps)
    rep = out["report"]
    print(f"{len(out['reps'])} repetitions, {rep['ops']} operations ({rep['acked_puts']} acknowledged puts): "
          f"{len(rep['violations'])} violation(s)")
    for v in rep["violations"][:10]:
        print("  " + v)
    return 1 if rep["violations"] or out["raised"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
