"""sdhcp's plug-in declaration (``vfab.vid.plugin``): everything vfab needs to know of it, in one place.

``vfab service add NAME --kind sdhcp [--opt NAME=VALUE ...]`` records the kind
and the dhcp4 front door (table 0: ``udp,tp_dst=67`` from host ports → the
service's VID whose key is the client MAC's hash, ``vfab.vid.mackey``'s
``mac-hash``: sequentially numbered MACs spread over the key space).  Options given
there are checked by the same code the shards use (``config.parse_opts``), so
an operator learns of a bad pool before starting any shard, and kept in the
service record (``Service.opts``), where every shard reads them at start
(``config.shard_config``: a shard's own ``--opt`` may change its lease times,
router, DNS and relays, not the pool).  Every lease record carries the pool's
fingerprint and shards of different pools refuse each other's records
(``store.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vfab.services.sdhcp.config import OPTIONS, parse_opts
from vfab.services.sdhcp.errors import DhcpError
from vfab.vid import mackey
from vfab.vid.errors import VidError
from vfab.vid.plugin import ServicePlugin, register


@dataclass(frozen=True)
class SdhcpPlugin(ServicePlugin):
    def service_frontdoors(self, opts: dict[str, str]) -> list[dict]:
        """The dhcp4 front door; ``opts`` (if any) must be a valid pool configuration."""
        if opts:
            try:
                parse_opts(opts)
            except DhcpError as exc:
                raise VidError(str(exc)) from None
        return super().service_frontdoors({})


PLUGIN = register(SdhcpPlugin(
    kind="sdhcp",
    summary="elastic DHCPv4 server for unmodified clients, sharded by client MAC; leases follow their keys "
            "through split, merge, move and mirror",
    wire="vfab.services.sdhcp.wire",
    key_of="vfab.services.sdhcp.plugin:key_of",
    backend="vfab.services.sdhcp.backend:open_backend",
    cli="vfab.services.sdhcp.cli:sdhcp",
    frontdoors=({"kind": "dhcp4", "key": mackey.HASH},),
    options=dict(OPTIONS),
))


def key_of(payload: bytes) -> int:
    """The VID key of an sdhcp request payload (``frames.py``) in a service this plug-in creates: chaddr's
    ``mac-hash`` key (the front door's; a shard keys by its own service's door: ``Store.key``)."""
    from vfab.services.sdhcp import frames, wire

    _, _, dhcp = frames.unwrap(payload)
    return mackey.key(wire.parse(dhcp).chaddr, mackey.HASH)
