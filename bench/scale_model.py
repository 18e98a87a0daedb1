"""The control-plane scale bench's pure parts: the workload, each node's route flows, a range change, the model.

**Workload.**  ``services`` services of ``ranges`` ranges each, over ``nodes`` nodes (fabric hosts, each
with its own switch).  A service's ranges are the leaves of repeated halvings of the 24-bit key space (what
elastic-KVS and sdhcp splits make: every range an aligned power-of-two block, one flow), spread over
``per_service`` nodes in contiguous stretches (a server owns neighbouring ranges, as splits leave them), the
nodes of service ``s`` starting at node ``s * per_service`` (so every node holds about as many ranges as
any other).  ``placement="interleaved"`` gives each range a random one of the service's nodes instead (the
worst case for remote prefixes: each stretch its own).

**Flows per node.**  ``node_flows`` compiles one node's route table with the two-level compiler
(``fabric/tworoute.py``): its own ranges exact, every other node's as ORTC prefixes.

**A range change** moves one range to another of its service's nodes (a new owner, epoch + 1):
``move``.  The nodes that need it are those whose compiled flows for that service change (``needed``).

**Model for the switches not emulated.**  With a route agent per host, each host's agent compiles and
commits its own switch in parallel with the others; what one change costs fabric-wide is the slowest of
the ``nodes`` agents that need it, plus etcd's fan-out of the watch event.  ``fabric_latency`` draws that
maximum from per-switch latencies measured on the real instances (``samples``), ``nodes`` at a time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from vfab.fabric.flows import FlowSpec
from vfab.fabric.tworoute import Owned, node_routes
from vfab.vid.codec import KEY_MAX

LOCAL_PORT = 1            # the port of a node's own endpoints (one per node in the model)
TUNNEL_BASE = 1000        # on every node, the tunnel to node j is port TUNNEL_BASE + j
PLACEMENTS = ("aligned", "contiguous", "interleaved")


class WorkloadError(ValueError):
    """A workload that cannot be built: says what is wrong and the limit."""


def split_ranges(n: int) -> list[tuple[int, int]]:
    """``n`` ranges from halving the key space breadth first (each an aligned block), sorted by ``lo``."""
    if not 1 <= n <= KEY_MAX + 1:
        raise WorkloadError(f"{n} ranges per service: give 1..{KEY_MAX + 1}")
    depth = n.bit_length() - 1                 # 2**depth <= n blocks of one size, the first n - 2**depth halved
    size = (KEY_MAX + 1) >> depth
    out = []
    for i in range(1 << depth):
        lo = i * size
        if i < n - (1 << depth):
            out += [(lo, lo + size // 2 - 1), (lo + size // 2, lo + size - 1)]
        else:
            out.append((lo, lo + size - 1))
    return out


def node_name(i: int) -> str:
    return f"n{i}"


@dataclass
class Workload:
    services: int
    ranges: int
    nodes: int
    per_service: int = 4
    placement: str = "aligned"
    seed: int = 1
    owned: dict[int, list[Owned]] = field(default_factory=dict)   # service id -> its ranges, by lo

    def __post_init__(self) -> None:
        if self.services < 1 or self.nodes < 1:
            raise WorkloadError(f"{self.services} services on {self.nodes} nodes: give at least 1 of each")
        if not 1 <= self.per_service <= self.nodes:
            raise WorkloadError(f"{self.per_service} nodes per service: give 1..{self.nodes} (the nodes)")
        if self.placement not in PLACEMENTS:
            raise WorkloadError(f"placement {self.placement!r}: one of {', '.join(PLACEMENTS)}")
        if not self.owned:
            self.owned = {sid: self._place(sid) for sid in range(1, self.services + 1)}

    def service_nodes(self, sid: int) -> list[str]:
        first = (sid - 1) * self.per_service
        return [node_name((first + k) % self.nodes + 1) for k in range(self.per_service)]

    def _place(self, sid: int) -> list[Owned]:
        where = self.service_nodes(sid)
        blocks = split_ranges(self.ranges)
        if self.placement == "aligned":       # the service's key space cut in equal stretches, one per node
            return [Owned(lo, hi, where[lo * len(where) >> 24], 1) for lo, hi in blocks]
        if self.placement == "contiguous":    # equal counts of neighbouring ranges per node
            return [Owned(lo, hi, where[i * len(where) // len(blocks)], 1) for i, (lo, hi) in enumerate(blocks)]
        rnd = random.Random(self.seed * 1_000_003 + sid)
        return [Owned(lo, hi, rnd.choice(where), 1) for lo, hi in blocks]

    @property
    def total_ranges(self) -> int:
        return sum(len(v) for v in self.owned.values())

    def local_ranges(self, me: str) -> int:
        return sum(1 for rs in self.owned.values() for r in rs if r.node == me)


def tunnel_ports(nodes: int, me: str) -> dict[str, int]:
    return {node_name(j): TUNNEL_BASE + j for j in range(1, nodes + 1) if node_name(j) != me}


def local_actions(_r: Owned) -> tuple:
    return (("output", LOCAL_PORT),)


def service_flows(w: Workload, sid: int, me: str, ports: dict[str, int] | None = None) -> list[FlowSpec]:
    """Node ``me``'s route flows for service ``sid``."""
    return node_routes(sid, "prefix", w.owned[sid], me, ports if ports is not None else tunnel_ports(w.nodes, me),
                       local_actions)


def node_flows(w: Workload, me: str) -> list[FlowSpec]:
    """Every route flow of node ``me``'s switch (a full recompile)."""
    ports = tunnel_ports(w.nodes, me)
    out: list[FlowSpec] = []
    for sid in w.owned:
        out += service_flows(w, sid, me, ports)
    return out


def move(w: Workload, sid: int, index: int, to: str) -> Workload:
    """``w`` with range ``index`` of service ``sid`` owned on ``to`` (epoch + 1); ``w`` is left as it was."""
    rs = list(w.owned[sid])
    if not 0 <= index < len(rs):
        raise WorkloadError(f"service {sid} has {len(rs)} ranges: no range {index}")
    rs[index] = replace(rs[index], node=to, epoch=rs[index].epoch + 1)
    return replace(w, owned={**w.owned, sid: rs})


def pick_change(w: Workload, rnd: random.Random) -> tuple[int, int, str]:
    """A range change as the balancer makes them: (service, range index, new node), the range moving to a
    neighbouring stretch's node of the same service (or any other node when the service has one node)."""
    sid = rnd.randrange(1, w.services + 1)
    index = rnd.randrange(w.ranges)
    here = w.owned[sid][index].node
    others = [n for n in w.service_nodes(sid) if n != here] or \
        [node_name(j) for j in range(1, w.nodes + 1) if node_name(j) != here]
    return sid, index, rnd.choice(others)


def flow_set(flows: list[FlowSpec]) -> set:
    return {(f.key, f.actions, f.cookie) for f in flows}


def needed(before: Workload, after: Workload, sid: int) -> dict[str, int]:
    """Node -> how many of its flows for ``sid`` change (adds + removes), for the nodes whose flows change."""
    out = {}
    for j in range(1, before.nodes + 1):
        me = node_name(j)
        a, b = flow_set(service_flows(before, sid, me)), flow_set(service_flows(after, sid, me))
        if a != b:
            out[me] = len(a ^ b)
    return out


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        raise ValueError("no samples")
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def fabric_latency(samples: list[float], nodes: int, fanout: float = 0.0, trials: int = 2000,
                   seed: int = 7) -> dict:
    """The model: one change's commit on all ``nodes`` switches, each a host of its own, is the slowest of
    ``nodes`` independent per-switch latencies drawn from ``samples`` (seconds, measured on real switches) plus
    ``fanout`` (seconds etcd takes to deliver the event to ``nodes`` watchers, measured).  Median and p99 over
    ``trials`` draws, in milliseconds."""
    if not samples:
        raise ValueError("the model needs per-switch latencies measured on real switches: none given")
    rnd = random.Random(seed)
    worst = [max(rnd.choice(samples) for _ in range(nodes)) + fanout for _ in range(trials)]
    return {"nodes": nodes, "median_ms": round(percentile(worst, 0.5) * 1e3, 3),
            "p99_ms": round(percentile(worst, 0.99) * 1e3, 3), "trials": trials}
