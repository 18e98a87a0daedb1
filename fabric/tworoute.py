"""Two-level routing (DESIGN.md §8): a service's routes on one node's switch, local ranges exact, the rest
as few prefixes per remote node as the ownership allows.

On node ``me`` a range owned by an endpoint on ``me`` compiles as today (its blocks, ``to_masks``, to the
local actions); a range owned on another node is only "into the tunnel to that node": its keys are covered
by prefixes chosen with ORTC (Draves et al., "Constructing optimal IP routing tables", INFOCOM'99) over the
24-bit key trie, each leaf labelled with the owner's node, local keys labelled "don't care" (their exact
flows sit above every prefix, so a prefix may cover them freely) and unowned keys labelled ``MISS`` (left
to the switch's VID-miss flow).  Longest prefix wins: a prefix of length L has priority ``PRIO_REMOTE + L``.
ORTC gives the fewest prefixes for that labelling, so a switch holds its own ranges' blocks plus, where the
nodes own contiguous stretches of keys, about one prefix per remote node: the count grows with the local
ranges and the number of nodes, not with the fabric's ranges.  Interleaved ownership costs more prefixes
(each stretch its own), never a wrong route.

Pure: the caller gives each range's owner node and the actions; the fake flow table checks the result.
``fabric/nodecompile.py`` builds a whole node's switch on ``remote_prefixes`` (its own priorities, the way back
for stragglers, and the cross-node cut-over order); ``node_routes`` is the plain two-level table of one service.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vfab.fabric.compiler import PRIO_VID, block_matcher
from vfab.fabric.flows import TABLE_ROUTE, FlowSpec, Kind, make_cookie, match
from vfab.vid.codec import KEY_BITS, Layout
from vfab.vid.ranges import Range, to_masks

MISS = ""                              # the label of keys no range owns
PRIO_REMOTE = PRIO_VID - 100 - KEY_BITS - 1   # remote prefixes: below every local range's exact blocks


@dataclass(frozen=True)
class Owned:
    """Range ``[lo, hi]`` of a service, owned on node ``node`` ("" = unowned), at ``epoch``."""

    lo: int
    hi: int
    node: str
    epoch: int = 0


@dataclass
class _Trie:
    labels: frozenset | None = None      # None: don't care (any label will do)
    zero: "_Trie | None" = None
    one: "_Trie | None" = None


def _insert(root: _Trie, value: int, plen: int, label: str | None) -> None:
    node = root
    for depth in range(plen):
        bit = value >> (KEY_BITS - 1 - depth) & 1
        child = node.one if bit else node.zero
        if child is None:
            child = _Trie()
            if bit:
                node.one = child
            else:
                node.zero = child
        node = child
    node.labels = None if label is None else frozenset([label])
    node.zero = node.one = None
    node.leaf = True  # type: ignore[attr-defined]


def _merge(a: frozenset | None, b: frozenset | None) -> frozenset | None:
    if a is None:
        return b
    if b is None:
        return a
    return (a & b) or (a | b)


def _pass2(node: _Trie) -> frozenset | None:
    """Bottom-up: the labels each subtree can take with the fewest prefixes (a missing half is MISS)."""
    if getattr(node, "leaf", False):
        return node.labels
    halves = [_pass2(c) if c is not None else frozenset([MISS]) for c in (node.zero, node.one)]
    node.labels = _merge(*halves)
    return node.labels


def _pass3(node: _Trie | None, value: int, depth: int, inherited: str, out: list[tuple[int, int, str]]) -> None:
    if node is None:       # an absent half is MISS: it needs a prefix of its own unless MISS is inherited
        if inherited != MISS:
            out.append((value, depth, MISS))
        return
    labels = node.labels
    hop = inherited
    if labels is not None and inherited not in labels:
        hop = min(labels)
        out.append((value, depth, hop))
    if getattr(node, "leaf", False):
        return
    _pass3(node.zero, value, depth + 1, hop, out)
    _pass3(node.one, value | 1 << (KEY_BITS - 1 - depth), depth + 1, hop, out)


def remote_prefixes(ranges: list[Owned], me: str) -> list[tuple[int, int, str]]:
    """ORTC over the key trie: (key value, prefix length, node or MISS), the fewest prefixes that send every
    key of a range owned elsewhere to its node (longest prefix first wins; ``me``'s keys: don't care)."""
    root = _Trie()
    for r in ranges:
        label = None if r.node == me else r.node
        for value, mask in to_masks(Range(r.lo, r.hi)):
            _insert(root, value, bin(mask).count("1"), label)
    _pass2(root)
    out: list[tuple[int, int, str]] = []
    _pass3(root, 0, 0, MISS, out)
    return out


def node_routes(service: int, layout: Layout | str, ranges: list[Owned], me: str, tunnel_port: dict[str, int],
                local: Callable[[Owned], tuple], miss: tuple = ()) -> list[FlowSpec]:
    """Table-1 flows of ``service`` on node ``me``'s switch.  ``tunnel_port``: the port of the tunnel to each
    other node; ``local(range)``: the actions of a range owned on ``me`` (as the single-host compiler makes
    them); ``miss``: the actions for a stretch of unowned keys a remote prefix would otherwise cover."""
    block = block_matcher(service, layout)
    flows = []
    for r in ranges:
        if r.node == me:
            cookie = make_cookie(Kind.VID_ROUTE, service, r.lo, r.epoch)
            acts = local(r)
            flows += [FlowSpec(TABLE_ROUTE, PRIO_VID, match(eth_dst=block(v, m)), acts, cookie)
                      for v, m in to_masks(Range(r.lo, r.hi))]
    full = (1 << KEY_BITS) - 1
    for value, plen, node in remote_prefixes(ranges, me):
        mask = full ^ (full >> plen)
        if node == MISS:
            acts = miss
        elif node in tunnel_port:
            acts = (("output", tunnel_port[node]),)
        else:
            acts = miss            # a node without a tunnel yet: its keys are not sent anywhere meanwhile
        cookie = make_cookie(Kind.REMOTE, service, value, plen)
        flows.append(FlowSpec(TABLE_ROUTE, PRIO_REMOTE + plen, match(eth_dst=block(value, mask)), acts, cookie))
    return flows
