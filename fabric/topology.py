"""Paths over the switch graph: next-hop port from every switch towards every other."""

from __future__ import annotations

from collections import deque


def next_hops(switches: list[int], links: list[tuple[int, int, int, int]]) -> dict[tuple[int, int], int]:
    """{(from_dpid, to_dpid): out_port} by shortest path (BFS; ties by lowest port).

    ``links`` are directed (dpid, port, peer_dpid, peer_port); a link is used only
    if its reverse is known too, so half-discovered links carry nothing.
    """
    adj: dict[int, list[tuple[int, int]]] = {s: [] for s in switches}
    have = {(a, b) for a, _, b, _ in links}
    for a, port, b, _ in sorted(links):
        if a in adj and b in adj and (b, a) in have:
            adj[a].append((port, b))
    hops: dict[tuple[int, int], int] = {}
    for dst in switches:
        # BFS from dst backwards: for each switch, the port that leads one step closer.
        seen = {dst}
        queue = deque([dst])
        while queue:
            cur = queue.popleft()
            for a in switches:
                if a in seen:
                    continue
                ports = sorted(p for p, b in adj[a] if b == cur)
                if ports:
                    hops[(a, dst)] = ports[0]
                    seen.add(a)
                    queue.append(a)
    return hops


def distances(switches: list[int], hops: dict[tuple[int, int], int],
              links: list[tuple[int, int, int, int]]) -> dict[tuple[int, int], int]:
    """Hop count between switches along the ``next_hops`` paths (0 to itself)."""
    peer = {(a, port): b for a, port, b, _ in links}
    dist: dict[tuple[int, int], int] = {}
    for src in switches:
        for dst in switches:
            cur, n = src, 0
            while cur != dst and (cur, dst) in hops and n <= len(switches):
                cur = peer.get((cur, hops[(cur, dst)]), dst)
                n += 1
            if cur == dst:
                dist[(src, dst)] = n
    return dist
