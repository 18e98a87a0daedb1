"""The fabric's desired state as read from etcd, parsed and checked once.

Malformed records are skipped with a warning (an operator's typo in etcd must
not take the controller down); ``problems`` lists them for ``vfab status``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vfab.vid.registry import schema
from vfab.vid.errors import RegistryError

log = logging.getLogger("vfab.state")


@dataclass
class FabricState:
    services: dict = field(default_factory=dict)    # name -> Service
    endpoints: dict = field(default_factory=dict)   # (service, name) -> Endpoint
    # (service, name) -> Endpoint whose record etcd deleted moments ago (its lease expired or was revoked) and
    # that has not come back: its ranges still reach it where nobody else serves them (the controller's linger)
    lingering: dict = field(default_factory=dict)
    ranges: dict = field(default_factory=dict)      # service -> [RangeRec] sorted by lo
    hosts: dict = field(default_factory=dict)       # mac -> Host
    bindings: dict = field(default_factory=dict)    # mac -> Binding (an sdhcp lease of a dhcp host)
    switches: dict = field(default_factory=dict)    # dpid -> Switch
    links: list = field(default_factory=list)       # [Link]
    miss: str = "drop"
    problems: list = field(default_factory=list)

    def owner_endpoint(self, service: str, name: str):
        """The endpoint ``name`` of ``service`` for routing its ranges as their owner: its live record, else the
        record of it that lingers (None if neither)."""
        return self.endpoints.get((service, name)) or self.lingering.get((service, name))

    @classmethod
    def from_items(cls, items: dict[str, bytes], cache: dict | None = None,
                   lingering: dict[str, bytes] | None = None) -> "FabricState":
        """Parse the ``/vfab/v1/`` items.  ``cache``: a dict the caller keeps between calls (key → (bytes,
        record)); a record whose bytes did not change is not parsed again.  It is pruned to the keys seen.
        Records are shared between the states built from one cache: treat them as read-only.
        ``lingering``: endpoint key → the last bytes of an endpoint record etcd deleted moments ago (see the
        field); one that is in ``items`` again, or does not parse, is left out."""
        st = cls()
        for key, value in sorted((lingering or {}).items()):
            parsed = schema.parse_key(key)
            if key in items or parsed is None or parsed[0] != "endpoints":
                continue
            try:
                rec = schema.RECORDS["endpoints"].from_json(value, key)
            except RegistryError:
                continue
            st.lingering[(rec.service, rec.name)] = rec
        seen: dict = {}
        for key, value in sorted(items.items()):
            parsed = schema.parse_key(key)
            if parsed is None:
                continue
            top, rest = parsed
            try:
                if top == "config" and rest == ["miss"]:
                    policy = value.decode()
                    if policy not in schema.MISS_POLICIES:
                        raise RegistryError(f"miss policy {policy!r} unknown")
                    st.miss = policy
                    continue
                rec_type = schema.RECORDS.get(top)
                if rec_type is None or top == "applied":
                    continue
                hit = cache.get(key) if cache is not None else None
                if hit is not None and hit[0] == value:
                    rec = hit[1]
                else:
                    rec = rec_type.from_json(value, key)
                if cache is not None:
                    seen[key] = (value, rec)
                if top == "services":
                    st.services[rec.name] = rec
                elif top == "endpoints":
                    st.endpoints[(rec.service, rec.name)] = rec
                elif top == "ranges":
                    st.ranges.setdefault(rest[0], []).append(rec)
                elif top == "hosts":
                    st.hosts[rec.mac] = rec
                elif top == "bindings":
                    st.bindings[rec.mac] = rec
                elif top == "switches":
                    st.switches[rec.dpid] = rec
                elif top == "links":
                    st.links.append(rec)
            except RegistryError as exc:
                st.problems.append(str(exc))
                log.warning("skipping %s: %s", key, exc)
        for recs in st.ranges.values():
            recs.sort(key=lambda r: r.lo)
        if cache is not None:
            cache.clear()
            cache.update(seen)
        return st
