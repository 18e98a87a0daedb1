"""controller/election.py on a real etcd: one active route agent per node; its generation only ever rises; a
standby takes over once the active one's lease ends (its process stopped renewing it)."""

from __future__ import annotations

import threading

from vfab.controller.election import Election
from vfab.testbed.etcd import LocalEtcd
from vfab.testbed.procs import wait_for
from vfab.vid.registry import Registry, schema


def test_one_leads_the_other_stands_by_then_takes_over_with_a_newer_generation(tmp_path):
    etcd = LocalEtcd(tmp_path / "etcd").start(timeout=20)
    reg = Registry(etcd.endpoint)
    try:
        seen: dict[str, list[int]] = {"a": [], "b": []}
        a = Election(reg, "host1", seen["a"].append, ttl=1, ident="a")
        b = Election(reg, "host1", seen["b"].append, ttl=1, ident="b")
        stop_a, stop_b = threading.Event(), threading.Event()
        threading.Thread(target=a.run, args=(stop_a,), daemon=True).start()
        wait_for(lambda: seen["a"], 5, "a leading")
        threading.Thread(target=b.run, args=(stop_b,), daemon=True).start()
        assert reg.get(schema.route_agent_key("host1"))[0] == b"a"
        assert not wait_for_quietly(lambda: seen["b"], 1.5)   # a keeps its lease: b stands by
        # another node's election is independent
        c = Election(reg, "host2", lambda g: None, ttl=1, ident="c")
        assert c.try_once() > 0
        stop_a.set()              # a stops renewing (and revokes): b takes over with a newer generation
        wait_for(lambda: seen["b"], 5, "b taking over")
        assert seen["a"] == [seen["a"][0], 0] and seen["b"][0] > seen["a"][0]
        assert reg.get(schema.route_agent_key("host1"))[0] == b"b"
        # a lease that etcd let expire (the agent was paused past it) ends b's lead: it reports 0
        reg.revoke(b.lease)
        wait_for(lambda: 0 in seen["b"], 5, "b standing down")
        stop_b.set()
    finally:
        reg.close()
        etcd.stop()


def wait_for_quietly(pred, timeout: float) -> bool:
    try:
        wait_for(pred, timeout, "-")
        return True
    except TimeoutError:
        return False
