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

Cost: neighbouring ranges of one label are merged into one stretch first (the same labelling of keys, so the
same prefixes), and a subtree one stretch covers is a leaf, so the trie holds only the paths to stretch ends
(about 24 nodes per stretch), not a node per bit of every range's blocks: 1,000 services x 100 ranges on 64
nodes take 0.02 s on one node here, 17x less than inserting every block bit by bit (bench/scale.py).

Pure: the caller gives each range's owner node and the actions; the fake flow table checks the result.
``fabric/nodecompile.py`` builds a whole node's switch on ``remote_prefixes`` (its own priorities, the way back
for stragglers, and the cross-node cut-over order); ``node_routes`` is the plain two-level table of one service.
"""

from __future__ import annotations

import bisect
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


# A trie node: (labels, zero child, one child, leaf).  ``labels`` None: don't care (any label will do); a
# child None: that half holds no block (its keys are MISS).
_Node = tuple


def _merge(a: frozenset | None, b: frozenset | None) -> frozenset | None:
    if a is None:
        return b
    if b is None:
        return a
    return (a & b) or (a | b)


_MISS_SET = frozenset([MISS])


def _build(spans: list[tuple[int, int, str | None]], los: list[int], i: int, j: int, value: int,
           depth: int) -> _Node | None:
    """The trie over ``spans[i:j]`` (sorted, disjoint (lo, hi, label) stretches of keys, each meeting the prefix
    ``value`` of length ``depth``; the first and last may reach past it), each node labelled bottom-up (ORTC's
    second pass: the labels a subtree can take with the fewest prefixes).  A subtree one stretch covers is a
    leaf, so the trie holds only the paths to the stretches' ends: built in one descent, cutting the stretches
    at each bit with a binary search on ``los`` (their starts)."""
    if i == j:
        return None
    end = value + (1 << (KEY_BITS - depth)) - 1
    if j - i == 1 and spans[i][0] <= value and spans[i][1] >= end:
        label = spans[i][2]
        return (None if label is None else frozenset([label]), None, None, True)
    mid = value | 1 << (KEY_BITS - 1 - depth)
    k = bisect.bisect_left(los, mid, i, j)
    zero = _build(spans, los, i, k, value, depth + 1)
    one = _build(spans, los, k - 1 if k > i and spans[k - 1][1] >= mid else k, j, mid, depth + 1)
    labels = _merge(_MISS_SET if zero is None else zero[0], _MISS_SET if one is None else one[0])
    return (labels, zero, one, False)


def _pass3(node: _Node | None, value: int, depth: int, inherited: str, out: list[tuple[int, int, str]]) -> None:
    if node is None:       # an absent half is MISS: it needs a prefix of its own unless MISS is inherited
        if inherited != MISS:
            out.append((value, depth, MISS))
        return
    labels, zero, one, leaf = node
    hop = inherited
    if labels is not None and inherited not in labels:
        hop = min(labels)
        out.append((value, depth, hop))
    if leaf:
        return
    _pass3(zero, value, depth + 1, hop, out)
    _pass3(one, value | 1 << (KEY_BITS - 1 - depth), depth + 1, hop, out)


def remote_prefixes(ranges: list[Owned], me: str) -> list[tuple[int, int, str]]:
    """ORTC over the key trie: (key value, prefix length, node or MISS), the fewest prefixes that send every
    key of a range owned elsewhere to its node (longest prefix first wins; ``me``'s keys: don't care)."""
    spans: list[list] = []     # neighbouring ranges of one label merged: the same labelling, fewer leaves
    for r in sorted(ranges, key=_by_lo):
        label = None if r.node == me else r.node
        if spans and spans[-1][2] == label and spans[-1][1] + 1 == r.lo:
            spans[-1][1] = r.hi
        else:
            spans.append([r.lo, r.hi, label])
    out: list[tuple[int, int, str]] = []
    _pass3(_build(spans, [sp[0] for sp in spans], 0, len(spans), 0, 0), 0, 0, MISS, out)
    return out


def _by_lo(r: Owned) -> int:
    return r.lo


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
