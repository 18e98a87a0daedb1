"""The controller's configuration: one validated record, handed to the os-ken app by ``main``.

Like the registry's records (``vfab.vid.registry.schema``), unknown keys and
wrong types are rejected with a message naming the key, the limit and the fix.
Sources, later ones winning: the defaults below, a JSON file (``--config``),
command-line options.  No environment variables.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from vfab.vid.errors import RegistryError, VidError
from vfab.vid.registry import members as etcd_members
from vfab.vid.registry import schema


class ConfigError(ValueError):
    """A controller setting that cannot be used."""


@dataclass(frozen=True)
class ControllerConfig:
    etcd: str = "127.0.0.1:2379"       # etcd members HOST:PORT[,HOST:PORT...] (their JSON gateway)
    listen: str = "127.0.0.1"          # OpenFlow listen address
    port: int = 6653                   # OpenFlow TCP port
    poll: float = 2.0                  # seconds between counter polls
    settle_ms: float = 5.0             # pause between switches of a hop-by-hop path when the datapath cannot be asked
    datapath_wait: bool = True         # ask the local ovs-vswitchd when its datapath follows the tables (controller/datapath.py)
    datapath_timeout: float = 5.0      # seconds to wait for a revalidation pass before going on regardless
    ovs_rundir: str = "/var/run/openvswitch"   # where the local ovs-vswitchd's pid file and control socket are
    audit_polls: int = 10              # counter polls between full-table audits
    bundle_timeout: float = 30.0       # seconds to wait for a bundle commit or a dump
    verbose: bool = False              # debug logging
    group_hold_ms: float = 200.0       # how long a group no flow uses any more is kept when the datapath cannot be
                                       # asked (else: until a revalidation pass followed; engine.place_groups)
    node: str = ""                     # route agent of this fabric node (its own switch only, fabric/nodecompile.py);
                                       # "" = the single-host controller of every switch in switches/
    node_whole: bool = False           # a route agent compiles its whole switch on every change (as before the
                                       # incremental compile; for comparison: bench/scale.py --route-compare)
    election_ttl: int = 1              # s: a route agent's election lease (controller/election.py): a dead agent's
                                       # standby takes over within it
    linger: float = 2.0                # seconds a range's frames still reach its owner after etcd deleted the
                                       # owner's endpoint record, while nobody else serves the range (0: never)
    metrics_port: int = 0              # port of the controller's Prometheus /metrics (0: any free one; -1: none)
    metrics_host: str = "127.0.0.1"    # address /metrics listens on (the host's control address for a remote scrape)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            want = {"str": str, "int": int, "float": (int, float), "bool": bool}[str(f.type)]
            if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
                kind = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}
                raise ConfigError(f"controller setting {f.name!r} must be {kind[str(f.type)]}, got {value!r}")
        try:
            etcd_members.parse(self.etcd)
        except RegistryError as exc:
            raise ConfigError(str(exc)) from None
        try:
            ipaddress.ip_address(self.listen)
        except ValueError:
            raise ConfigError(f"listen address {self.listen!r} is not an IP address: e.g. 127.0.0.1 "
                              "(0.0.0.0 for every interface)") from None
        if not 0 < self.port < 65536:
            raise ConfigError(f"OpenFlow port {self.port} is out of range: 1..65535 (6653 is the IANA port)")
        if not 0.05 <= self.poll <= 3600:
            raise ConfigError(f"poll period {self.poll} s is out of range: 0.05..3600 s")
        if not 0 <= self.settle_ms <= 1000:
            raise ConfigError(f"settle pause {self.settle_ms} ms is out of range: 0..1000 ms")
        if not 0.1 <= self.datapath_timeout <= 60:
            raise ConfigError(f"datapath_timeout {self.datapath_timeout} s is out of range: 0.1..60 s")
        if not self.ovs_rundir.startswith("/"):
            raise ConfigError(f"ovs_rundir {self.ovs_rundir!r} must be an absolute path, e.g. /var/run/openvswitch")
        if not 1 <= self.audit_polls <= 100000:
            raise ConfigError(f"audit_polls {self.audit_polls} is out of range: 1..100000 counter polls")
        if not 0 <= self.group_hold_ms <= 60000:
            raise ConfigError(f"group_hold_ms {self.group_hold_ms} ms is out of range: 0..60000 ms")
        if not 0 <= self.linger <= 60:
            raise ConfigError(f"linger {self.linger} s is out of range: 0..60 s (longer than the endpoints' keep-alive "
                              "period, so that a machine paused past their leases loses no frame; 2 s by default)")
        if self.node:
            try:
                schema.check_name("node", self.node)
            except VidError as exc:
                raise ConfigError(f"node {self.node!r}: {exc} (the name it joined with: 'vfab node list')") from None
        if not 1 <= self.election_ttl <= 60:
            raise ConfigError(f"election_ttl {self.election_ttl} s is out of range: 1..60 s (etcd's minimum lease is "
                              "1.5 election timeouts, rounded up to whole seconds)")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port {self.metrics_port} is out of range: 0..65535 (0: any free port, -1: no "
                              "metrics)")
        try:
            ipaddress.ip_address(self.metrics_host)
        except ValueError:
            raise ConfigError(f"metrics_host {self.metrics_host!r} is not an IP address: e.g. 127.0.0.1") from None
        if not 1 <= self.bundle_timeout <= 3600:
            raise ConfigError(f"bundle_timeout {self.bundle_timeout} s is out of range: 1..3600 s")

    @property
    def settle(self) -> float:
        """The settle pause in seconds."""
        return self.settle_ms / 1e3

    @property
    def group_hold(self) -> float:
        """The fallback hold of unused groups in seconds."""
        return self.group_hold_ms / 1e3

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "controller config") -> "ControllerConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be a JSON object of settings, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"{where} has unknown settings {unknown}: known settings are {known}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str, where: str = "controller config") -> "ControllerConfig":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{where} is not JSON: {exc}") from None
        return cls.from_dict(data, where)

    def merged(self, **changes: Any) -> "ControllerConfig":
        """A copy with ``changes`` applied (None values ignored), validated again."""
        data = asdict(self)
        data.update({k: v for k, v in changes.items() if v is not None})
        return self.from_dict(data)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)
