"""services/elastic-kvs/loadgen.py: the closed-loop driver and the history it records (a client in memory)."""

from __future__ import annotations

import gc
import itertools

from vfab.services.elastic_kvs import loadgen
from vfab.services.elastic_kvs.client import Pending
from vfab.services.elastic_kvs.proto import Op, Reply, Status


class Client:
    """Answers every request at the next poll: a PUT stores, a GET reads, a DEL deletes; one in 5 times out."""

    client_id = 123456

    def __init__(self):
        self.inflight: dict[int, Pending] = {}
        self.data: dict[bytes, bytes] = {}
        self.ids = itertools.count(1)
        self.t = itertools.count(1)

    def submit(self, op, key, value=b"", tag=None):
        p = Pending(op, key, value, next(self.ids), 0, float(next(self.t)), tag=tag)
        self.inflight[p.reqid] = p
        return p

    def poll(self, timeout):
        done = list(self.inflight.values())
        self.inflight.clear()
        for p in done:
            p.finished = float(next(self.t))
            if p.reqid % 5 == 0:
                p.error = "no reply"
                continue
            status, body = Status.OK, b""
            if p.op is Op.PUT:
                self.data[p.key] = p.value
            elif p.op is Op.GET:
                body = self.data.get(p.key, b"")
                status = Status.OK if p.key in self.data else Status.NOT_FOUND
            else:
                status = Status.OK if self.data.pop(p.key, None) is not None else Status.NOT_FOUND
            p.reply = Reply(status, p.reqid, p.reqid, body, self.client_id)
        return done


def test_the_history_names_each_operation_what_it_saw_and_when():
    client, waits = Client(), []
    history = loadgen.drive(client, 3, 0.05, [b"a", b"b"], (1, 1, 1), 16, seed=7, waits=waits)
    assert len(history) > 30 and len(waits) == len(history) and all(w >= 0 for w in waits)
    assert gc.isenabled()
    puts = [h for h in history if h[1] == "PUT" and h[6] == "OK"]
    assert puts and len({h[3] for h in puts}) == len(puts)          # every write is told apart by its value
    assert all(h[3].startswith("c23456_") for h in puts)
    for c, op, key, value, invoked, responded, status, version in history:
        assert c in (0, 1, 2) and op in ("PUT", "GET", "DEL") and key in ("a", "b") and invoked < responded
        assert status in ("OK", "NOT_FOUND", "TIMEOUT")
        assert (version == 0) == (status == "TIMEOUT")
        if op == "GET" and status == "OK":
            assert value is not None and value.startswith("c23456_")   # the write it read
        elif op != "PUT":
            assert value is None
    # each logical client has one operation in flight: its entries are invoked one after the other
    for c in (0, 1, 2):
        mine = [h for h in history if h[0] == c]
        assert all(a[5] < b[4] for a, b in zip(mine, mine[1:]))


def test_the_collector_is_left_as_it_was():
    gc.disable()
    try:
        loadgen.drive(Client(), 1, 0.01, [b"a"], (1, 0, 0), 8)
        assert not gc.isenabled()
    finally:
        gc.enable()
