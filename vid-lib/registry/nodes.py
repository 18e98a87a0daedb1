"""Fabric nodes (hosts with their own Open vSwitch) in the registry: join, refresh, leave, list.

A node's record (``schema.Node`` at ``schema.node_key(name)``) and its tunnel address's claim
(``schema.node_ip_key(ip)`` -> name) live under one lease, its agent's: when the agent stops renewing it,
both go together and every other node removes its tunnel to it.  A join is one etcd transaction that
creates both only if neither exists, so two machines can never hold one name or one tunnel address.
"""

from __future__ import annotations

import base64
import logging

from vfab.vid.errors import Conflict, NotFound, RegistryError
from vfab.vid.registry import schema
from vfab.vid.registry.etcd import Registry

log = logging.getLogger("vfab.registry.nodes")


def nodes(reg: Registry) -> dict[str, schema.Node]:
    """Every well-formed node record, by name (a malformed one is logged and left out)."""
    _, items = reg.get_prefix(schema.folder("nodes"))
    out = {}
    for key, (raw, _) in items.items():
        try:
            node = schema.Node.from_json(raw, key)
        except RegistryError as exc:
            log.warning("%s", exc)
            continue
        out[node.name] = node
    return out


def _holder(reg: Registry, key: str) -> str:
    """Who holds node record ``key`` and for how long still, for an error message."""
    got = reg.get(key)
    lease = reg.lease_of(key)
    if got is None:
        return "nobody any more (it just left: try again)"
    try:
        node = schema.Node.from_json(got[0], key)
        who = f"node {node.name} at {node.tunnel_ip}, agent {node.agent or '?'}"
    except RegistryError:
        who = got[0].decode(errors="replace")[:200]
    if lease:
        try:
            out = reg._post("/lease/timetolive", {"ID": str(lease)})   # noqa: SLF001 - a read-only lease query
            who += f"; its lease ends in {int(out.get('TTL', 0))} s unless its agent renews it"
        except RegistryError:
            pass
    return who


def join(reg: Registry, node: schema.Node, lease: int, *, retake: bool = False) -> int:
    """Register ``node`` under ``lease``; the revision.  Conflict if its name or tunnel address is taken by a
    live node.  ``retake``: the records may already exist under this same ``lease`` (an agent re-registering
    after a restart within the lease's TTL): they are overwritten then."""
    key, ip_key = schema.node_key(node.name), schema.node_ip_key(node.tunnel_ip)
    compares = [reg.cmp_mod(key, 0), reg.cmp_mod(ip_key, 0)]
    if retake:
        compares = [_cmp_lease(key, lease), _cmp_lease(ip_key, lease)]
    ok, rev = reg.txn(compares, {key: node.to_json(), ip_key: node.name}, lease=lease)
    if ok:
        return rev
    name_owner = reg.get(key)
    ip_owner = reg.get(ip_key)
    if name_owner is not None and (not retake or reg.lease_of(key) != lease):
        raise Conflict(f"node name {node.name!r} is taken by a live node: {_holder(reg, key)}. Pick another "
                       f"--name, or run 'vfab node leave --name {node.name}' if that machine is gone")
    if ip_owner is not None and (not retake or reg.lease_of(ip_key) != lease):
        other = ip_owner[0].decode(errors="replace")
        raise Conflict(f"tunnel address {node.tunnel_ip} is already taken by node {other!r}: each node needs its "
                       f"own underlay address (--tunnel-ip); if that node is gone, 'vfab node leave --name {other}' "
                       "frees it")
    raise Conflict(f"node {node.name!r} could not be registered (its records changed meanwhile): try again")


def _cmp_lease(key: str, lease: int) -> dict:
    """Compare: ``key`` is attached to ``lease`` (etcd's gateway takes keys in base64)."""
    return {"key": base64.b64encode(key.encode()).decode(), "result": "EQUAL", "target": "LEASE",
            "lease": str(lease)}


def update(reg: Registry, node: schema.Node, lease: int) -> bool:
    """Rewrite a node's record (its ports or peers changed) if it is still held under ``lease``; False when
    it is not (it left, or its lease ended)."""
    key = schema.node_key(node.name)
    ok, _ = reg.txn([_cmp_lease(key, lease)], {key: node.to_json()}, lease=lease)
    return ok


def leave(reg: Registry, name: str) -> schema.Node:
    """Remove node ``name`` (its record and its tunnel address's claim); the record it had."""
    key = schema.node_key(name)
    got = reg.get(key)
    if got is None:
        known = ", ".join(sorted(nodes(reg))) or "none"
        raise NotFound(f"node {name!r} is not registered (nodes: {known})")
    node = schema.Node.from_json(got[0], key)
    ip_key = schema.node_ip_key(node.tunnel_ip)
    deletes = [key]
    claim = reg.get(ip_key)
    if claim is not None and claim[0].decode(errors="replace") == name:
        deletes.append(ip_key)
    ok, _ = reg.txn([reg.cmp_mod(key, got[1])], {}, deletes)
    if not ok:
        raise Conflict(f"node {name!r} changed while leaving: try again")
    return node
