"""etcd key layout (DESIGN.md §4): the only module that knows key names.

::

    /vfab/v1/services/<name>               Service   {id, layout}
    /vfab/v1/service-ids/<id>              <name>    (makes ids unique)
    /vfab/v1/endpoints/<service>/<name>    Endpoint  {mac, rx, host}   leased: lease = liveness
    /vfab/v1/ranges/<service>/<lo:06x>     RangeRec  {lo, hi, owner, mirrors, helpers, epoch, state[, weights]}
    /vfab/v1/hosts/<mac>                   Host      {dpid, port, name, ips, dhcp}  where a MAC attaches
    /vfab/v1/bindings/<mac>                Binding   {mac, ip, until, service, shard}  an address a DHCP service
                                                     leased to a ``dhcp`` host, by the shard that acknowledged it
    /vfab/v1/switches/<dpid:016x>          Switch    {dpid, name}
    /vfab/v1/links/<dpid:016x>/<port>      Link      {dpid, port, peer_dpid, peer_port}
    /vfab/v1/config/miss                   "drop" | "controller" | "flood"
    /vfab/v1/applied/<dpid:016x>           Applied   {revision, flows, groups, at}  written by the controller
    /vfab/v1/counters/<dpid:016x>          Counters  {at, counters: {name: [packets, bytes]}}  leased, by the
                                                     controller
    /vfab/v1/ops/<service>/<op id>         OpRec     {id, op, source, ranges, peer, phase, done, total, ...}
                                                     a state op (one running per endpoint), leased by its source
    /vfab/v1/load/<service>/<endpoint>     Load      {at, ranges: [[lo, hi, keys, req/s]]}  leased, by it
    /vfab/v1/balancer/<service>            BalancerStatus {at, runner, decisions, view, problems}  by the balancer
    /vfab/v1/helpers/<service>/<endpoint>  HelperStatus {at, serves, pid, stats}  leased by a PostMan helper's
                                                     agent (the endpoint's lease): the endpoint is a helper
    /vfab/v1/holds/<service>               Holds     {holds: [[lo, hi, what, at]]}  ranges whose helpers an
                                                     operator set by hand: the balancer leaves them alone
    /vfab/v1/nodes/<name>                  Node      {name, tunnel_ip, dpid, bridge, ports, peers, ...}  a fabric
                                                     host (its Open vSwitch), leased by its node agent
    /vfab/v1/node-ips/<tunnel ip>          <name>    same lease: makes tunnel addresses unique
    /vfab/v1/route-agents/<node>           <pid@host> the node's active route agent, leased by it; its create
                                                     revision is the OpenFlow generation_id (the election)
    /vfab/v1/usage/<service>/<endpoint>    Usage     {at, cpu, served, cores, window, every, source, error}  leased
                                                     by a reporter beside the endpoint's process (its CPU and requests)
    /vfab/v1/leaders/<role>/<scope>        Leader    {who, since, lease}  leased by the elected process (e.g.
                                                     leaders/balancer/<service>): one active at a time
    /vfab/v1/sdhcp/<service>/blocks        block table {v, pool, blocks: [[a, b, anchor]]}  which addresses of
                                                     an sdhcp pool are anchored away from their home keys
                                                     (services/sdhcp/blocks.py owns the format)
    /vfab/v1/sdhcp/<service>/wants/<shard> Want      {need, parked, anchor, at}  a shard asking for addresses,
                                                     leased by it (services/sdhcp/agent.py)

``hosts/`` holds where a MAC attaches (a port's record); a machine of the fabric is a *node* (``vfab node
join``), kept in ``nodes/`` so the controller never recompiles on a node's changes (``PASSIVE``).
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from vfab.vid.codec import KEY_MAX, SERVICE_MAX, Layout, int_to_mac, mac_to_int
from vfab.vid.errors import RegistryError, VidError
from vfab.vid.ranges import Range

ROOT = "/vfab/v1/"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
MISS_POLICIES = ("drop", "controller", "flood")
RX_MODES = ("ovs", "bpf", "promisc")
RANGE_STATES = ("active", "unassigned", "moving")
WEIGHT_DEFAULT = 100    # a helper's bucket weight when its range names none (the balancer's weights are 1..100)
WEIGHT_MAX = 65535
OPTS_MAX = 32                     # options of one service (Service.opts)
OPT_LEN_MAX = 1024                # characters of one option's value
OPT_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise VidError(
            f"{kind} name {name!r} is invalid: use 1-63 chars of a-z, 0-9, '_', '.', '-', "
            "starting with a letter or digit"
        )
    return name


def folder(name: str) -> str:
    """The prefix of a top-level folder ("services", "switches", "counters", ...); see the table above."""
    if name not in FOLDERS:
        raise VidError(f"unknown registry folder {name!r}: one of {', '.join(FOLDERS)}")
    return f"{ROOT}{name}/"


def service_key(name: str) -> str:
    return f"{ROOT}services/{name}"


def service_id_key(sid: int) -> str:
    return f"{ROOT}service-ids/{sid}"


def endpoint_prefix(service: str) -> str:
    return f"{ROOT}endpoints/{service}/"


def endpoint_key(service: str, name: str) -> str:
    return endpoint_prefix(service) + name


def range_prefix(service: str) -> str:
    return f"{ROOT}ranges/{service}/"


def range_key(service: str, lo: int) -> str:
    return f"{range_prefix(service)}{lo:06x}"


def host_key(mac: str) -> str:
    return f"{ROOT}hosts/{int_to_mac(mac_to_int(mac))}"


def binding_key(mac: str) -> str:
    return f"{ROOT}bindings/{int_to_mac(mac_to_int(mac))}"


def switch_key(dpid: int) -> str:
    return f"{ROOT}switches/{dpid:016x}"


def link_key(dpid: int, port: int) -> str:
    return f"{ROOT}links/{dpid:016x}/{port}"


def node_key(name: str) -> str:
    return f"{ROOT}nodes/{check_name('node', name)}"


def route_agent_key(node: str) -> str:
    """The election of node ``node``'s route agent: held (leased) by the active one; its create revision is the
    OpenFlow generation_id it fences its switch with (controller/election.py)."""
    return f"{ROOT}route-agents/{check_name('node', node)}"


def node_ip_key(ip: str) -> str:
    return f"{ROOT}node-ips/{ipaddress.IPv4Address(ip)}"


def sdhcp_prefix(service: str) -> str:
    return f"{ROOT}sdhcp/{service}/"


def sdhcp_blocks_key(service: str) -> str:
    return f"{ROOT}sdhcp/{service}/blocks"


def sdhcp_want_prefix(service: str) -> str:
    return f"{ROOT}sdhcp/{service}/wants/"


def sdhcp_want_key(service: str, shard: str) -> str:
    return f"{ROOT}sdhcp/{service}/wants/{check_name('endpoint', shard)}"


MISS_KEY = f"{ROOT}config/miss"
FOLDERS = ("services", "service-ids", "endpoints", "ranges", "hosts", "bindings", "switches", "links", "config",
           "applied", "counters", "ops", "load", "balancer", "helpers", "holds", "nodes", "node-ips", "route-agents",
           "usage", "leaders", "sdhcp")


def op_key(service: str, op_id: str) -> str:
    return f"{ROOT}ops/{service}/{op_id}"


def op_prefix(service: str) -> str:
    return f"{ROOT}ops/{service}/"


def load_prefix(service: str) -> str:
    return f"{ROOT}load/{service}/"


def load_key(service: str, endpoint: str) -> str:
    return f"{ROOT}load/{service}/{endpoint}"


def balancer_key(service: str) -> str:
    return f"{ROOT}balancer/{service}"


def helper_prefix(service: str) -> str:
    return f"{ROOT}helpers/{service}/"


def helper_key(service: str, endpoint: str) -> str:
    return f"{ROOT}helpers/{service}/{endpoint}"


def holds_key(service: str) -> str:
    return f"{ROOT}holds/{service}"


def applied_key(dpid: int) -> str:
    return f"{ROOT}applied/{dpid:016x}"


def counters_key(dpid: int) -> str:
    return f"{ROOT}counters/{dpid:016x}"


class Record:
    """JSON record with a typed schema: unknown keys and wrong types are rejected."""

    KIND: ClassVar[str] = "record"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str, where: str = "") -> Any:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RegistryError(f"{cls.KIND} at {where or '?'} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RegistryError(f"{cls.KIND} at {where or '?'} is not a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise RegistryError(
                f"{cls.KIND} at {where or '?'} has unknown fields {sorted(unknown)}: "
                f"known fields are {sorted(known)}"
            )
        try:
            return cls(**data)
        except (TypeError, VidError) as exc:
            raise RegistryError(f"{cls.KIND} at {where or '?'} is invalid: {exc}") from None


def _need(kind: str, name: str, value: Any, typ: type | tuple) -> None:
    if not isinstance(value, typ) or isinstance(value, bool) and typ is not bool:
        raise VidError(f"{kind} field {name!r} has the wrong type: {value!r}")


@dataclass
class Service(Record):
    KIND: ClassVar[str] = "service"
    name: str
    id: int
    layout: str = Layout.PREFIX.value
    kind: str = ""   # the service type (a vfab.vid.plugin kind, e.g. "elastic-kvs"); "" = not declared
    # Front doors: table-0 classifiers that turn a real protocol into this service's VIDs, e.g.
    # {"kind": "dhcp4"} or {"kind": "udp", "ip": "10.0.0.100", "port": 11211, "key": "ip_src"}.
    # The kinds and their parameters are defined by vfab.fabric.frontdoor.
    frontdoors: list = field(default_factory=list)
    # The kind's options as the operator gave them ('vfab service add NAME --kind K --opt NAME=VALUE'), checked
    # by its plug-in there; the service's endpoints read them at start (e.g. an sdhcp pool: one place for all).
    opts: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_name("service", self.name)
        _need("service", "id", self.id, int)
        if not 1 <= self.id <= SERVICE_MAX:
            raise VidError(f"service id {self.id} is out of range: 1..{SERVICE_MAX}")
        Layout.parse(self.layout)
        _need("service", "kind", self.kind, str)
        if self.kind:
            check_name("service kind", self.kind)
        _need("service", "frontdoors", self.frontdoors, list)
        for door in self.frontdoors:
            if not isinstance(door, dict) or not isinstance(door.get("kind"), str):
                raise VidError(f"front door {door!r} of service {self.name!r} is malformed: each is an object "
                               'with a "kind" (e.g. {"kind": "dhcp4"})')
            for k, v in door.items():
                if not isinstance(k, str) or not isinstance(v, (str, int)) or isinstance(v, bool):
                    raise VidError(f"front door {door!r} of service {self.name!r}: parameter {k!r} must be a "
                                   "string or an integer")
        _need("service", "opts", self.opts, dict)
        if len(self.opts) > OPTS_MAX:
            raise VidError(f"service {self.name!r} has {len(self.opts)} options: the limit is {OPTS_MAX}")
        for k, v in self.opts.items():
            if not isinstance(k, str) or not OPT_RE.match(k) or not isinstance(v, str) or len(v) > OPT_LEN_MAX:
                raise VidError(f"option {str(k)[:40]!r}={str(v)[:60]!r} of service {self.name!r} is malformed: "
                               f"a name of a-z, 0-9, '_', '-' and a string of at most {OPT_LEN_MAX} characters")


@dataclass
class Endpoint(Record):
    KIND: ClassVar[str] = "endpoint"
    service: str
    name: str
    mac: str
    rx: str = "ovs"
    host: str = ""
    ctl: str = ""  # ZeroMQ control address (tcp://HOST:PORT) of a stateful endpoint, "" if none

    def __post_init__(self) -> None:
        check_name("service", self.service)
        check_name("endpoint", self.name)
        _need("endpoint", "host", self.host, str)
        _need("endpoint", "ctl", self.ctl, str)
        self.mac = int_to_mac(mac_to_int(self.mac))
        if self.rx not in RX_MODES:
            raise VidError(f"receive mode {self.rx!r} is unknown: use one of {', '.join(RX_MODES)}")


@dataclass
class RangeRec(Record):
    KIND: ClassVar[str] = "range"
    lo: int
    hi: int
    owner: str = ""
    mirrors: list = field(default_factory=list)
    helpers: list = field(default_factory=list)
    epoch: int = 0
    state: str = "active"
    # Bucket weights of the helpers' select group, by helper name (OpenFlow's 16-bit weight, 1..65535); a helper
    # not named here weighs WEIGHT_DEFAULT.  Written by the balancer (∝ spare capacity) or 'vfab helpers on
    # --weight'.  Left out of the JSON when empty, so records without helpers read and compare as before.
    weights: dict = field(default_factory=dict)

    def to_json(self) -> str:
        d = asdict(self)
        if not d["weights"]:
            del d["weights"]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    def weight(self, helper: str) -> int:
        return self.weights.get(helper, WEIGHT_DEFAULT)

    def __post_init__(self) -> None:
        for n in ("lo", "hi", "epoch"):
            _need("range", n, getattr(self, n), int)
        Range(self.lo, self.hi)
        if self.hi > KEY_MAX:
            raise VidError(f"range hi {self.hi} is past the key space (max {KEY_MAX})")
        _need("range", "owner", self.owner, str)
        _need("range", "mirrors", self.mirrors, list)
        _need("range", "helpers", self.helpers, list)
        for n in (*self.mirrors, *self.helpers):
            check_name("mirror/helper endpoint", n)
        _need("range", "weights", self.weights, dict)
        for n, w in self.weights.items():
            if n not in self.helpers:
                raise VidError(f"range weight for {n!r} names no helper of the range (helpers: "
                               f"{', '.join(self.helpers) or 'none'}): weights are per helper")
            if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= WEIGHT_MAX:
                raise VidError(f"range weight {w!r} of helper {n!r} is out of range: an integer 1..{WEIGHT_MAX} "
                               "(OpenFlow's bucket weight; take a helper out instead of weighting it 0)")
        if self.state not in RANGE_STATES:
            raise VidError(f"range state {self.state!r} is unknown: {', '.join(RANGE_STATES)}")

    @property
    def range(self) -> Range:
        return Range(self.lo, self.hi)


@dataclass
class Host(Record):
    """A host port's MAC.  ``ips``: the IPv4 addresses that MAC may send from; when given, front-door requests
    (the ``udp`` kind's) from any other source address are dropped at the port (the source guard: no reflection
    of a service's replies to someone else's address).  ``dhcp``: its addresses come from DHCP: guarded by the
    bindings an sdhcp service publishes for its leases (besides ``ips``), and with none yet every such request
    of it is dropped.  Neither: not guarded."""
    KIND: ClassVar[str] = "host"
    mac: str
    dpid: int
    port: int
    name: str = ""
    ips: list = field(default_factory=list)
    dhcp: bool = False

    def __post_init__(self) -> None:
        self.mac = int_to_mac(mac_to_int(self.mac))
        _need("host", "dpid", self.dpid, int)
        _need("host", "port", self.port, int)
        _need("host", "name", self.name, str)
        _need("host", "ips", self.ips, list)
        _need("host", "dhcp", self.dhcp, bool)
        norm = set()
        for ip in self.ips:
            try:
                if not isinstance(ip, str):
                    raise TypeError(ip)
                norm.add(str(ipaddress.IPv4Address(ip)))
            except (ValueError, TypeError):
                raise VidError(f"host {self.mac}: {ip!r} in 'ips' is not an IPv4 address (dotted quad, e.g. "
                               "10.0.0.1)") from None
        self.ips = sorted(norm, key=lambda a: ipaddress.IPv4Address(a))


@dataclass
class Binding(Record):
    """An address ``ip`` leased to the host ``mac`` until ``until`` (unix seconds) by shard ``shard`` of the
    DHCP service ``service`` (the key: ``binding_key(mac)``, one per MAC).  Source-guarded doors take that
    host's requests from ``ip`` while the lease lasts; an ended one is ignored."""
    KIND: ClassVar[str] = "binding"
    mac: str
    ip: str
    until: float
    service: str
    shard: str = ""

    def __post_init__(self) -> None:
        self.mac = int_to_mac(mac_to_int(self.mac))
        _need("binding", "ip", self.ip, str)
        try:
            self.ip = str(ipaddress.IPv4Address(self.ip))
        except ValueError:
            raise VidError(f"binding {self.mac}: {self.ip!r} is not an IPv4 address") from None
        _need("binding", "until", self.until, (int, float))
        check_name("service", self.service)
        _need("binding", "shard", self.shard, str)


@dataclass
class Switch(Record):
    KIND: ClassVar[str] = "switch"
    dpid: int
    name: str = ""

    def __post_init__(self) -> None:
        _need("switch", "dpid", self.dpid, int)
        _need("switch", "name", self.name, str)


@dataclass
class Link(Record):
    KIND: ClassVar[str] = "link"
    dpid: int
    port: int
    peer_dpid: int
    peer_port: int

    def __post_init__(self) -> None:
        for n in ("dpid", "port", "peer_dpid", "peer_port"):
            _need("link", n, getattr(self, n), int)


@dataclass
class Applied(Record):
    """A switch holds ``revision``: its tables since ``committed``; ``datapath``: its datapath follows them
    too (a whole revalidation pass of its daemon ended after the commit, at ``at``); False when the
    controller could not ask the daemon (then ``at`` is only when the report was written)."""
    KIND: ClassVar[str] = "applied"
    dpid: int
    revision: int
    flows: int
    groups: int = 0
    at: float = 0.0
    committed: float = 0.0
    datapath: bool = False

    def __post_init__(self) -> None:
        for n in ("dpid", "revision", "flows", "groups"):
            _need("applied", n, getattr(self, n), int)
        for n in ("at", "committed"):
            _need("applied", n, getattr(self, n), (int, float))
        _need("applied", "datapath", self.datapath, bool)


OP_KINDS = ("split", "move", "mirror")   # what the state machine runs
OP_NAMES = (*OP_KINDS, "merge")          # what a record says: a merge is a split the operator asked as one
OP_PHASES = ("prepare", "copy", "flip", "done", "failed", "cancelled")


@dataclass
class OpRec(Record):
    """A state operation (split/move/mirror) run by its source endpoint.  A merge ('vfab merge', the balancer's
    merge) is a split of the owner's range to the peer that joins it to its own: ``op`` "merge", the source the
    owner that gives the range, the peer the endpoint that takes it (records before this said "split")."""

    KIND: ClassVar[str] = "op"
    op: str
    source: str
    peer: str
    ranges: list
    phase: str = "prepare"
    done: int = 0
    total: int = 0
    started: float = 0.0
    updated: float = 0.0
    error: str = ""
    timings: dict = field(default_factory=dict)
    id: str = ""                                  # "<source>.<hex>": the op's key under ops/<service>/
    notes: list = field(default_factory=list)     # what went wrong after the commit (the op still succeeded)

    def __post_init__(self) -> None:
        _need("op", "id", self.id, str)
        _need("op", "notes", self.notes, list)
        if self.op not in OP_NAMES:
            raise VidError(f"op {self.op!r} is unknown: one of {', '.join(OP_NAMES)}")
        if self.phase not in OP_PHASES:
            raise VidError(f"op phase {self.phase!r} is unknown: one of {', '.join(OP_PHASES)}")
        for n in ("done", "total"):
            _need("op", n, getattr(self, n), int)
        _need("op", "ranges", self.ranges, list)

    @property
    def finished(self) -> bool:
        return self.phase in ("done", "failed", "cancelled")


@dataclass
class Load(Record):
    """What a stateful endpoint reports about its ranges: [[lo, hi, keys, requests/s(, median key)], ...] (the
    median key: below it lie half of the range's records, where the backend tells it)."""

    KIND: ClassVar[str] = "load"
    at: float
    ranges: list = field(default_factory=list)
    role: dict = field(default_factory=dict)  # "lo" (hex) -> "owner" | "mirror"


@dataclass
class Counters(Record):
    """Per-switch flow counters the controller publishes: {"<service id>/<lo:06x>" | "deny/<port>" |
    "vid_miss/<n>" | "guard/<service id>" | "spoofed/<service id>": [packets, bytes]}."""

    KIND: ClassVar[str] = "counters"
    at: float
    counters: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _need("counters", "at", self.at, (int, float))
        _need("counters", "counters", self.counters, dict)
        for name, pair in self.counters.items():
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, int) for x in pair)):
                raise VidError(f"counter {name!r} is not [packets, bytes]: {pair!r}")


@dataclass
class BalancerStatus(Record):
    """What the balancer (``vfab balancer run``) last saw and decided for one service, so 'vfab balancer
    status' can show why: ``decisions`` newest last, each {at, action, ranges, reason, result, ...};
    ``view`` what its model predicted per owner; ``runner`` who writes it; ``at`` its last round."""

    KIND: ClassVar[str] = "balancer"
    at: float
    runner: str = ""
    decisions: list = field(default_factory=list)
    view: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)

    def __post_init__(self) -> None:
        _need("balancer", "at", self.at, (int, float))
        _need("balancer", "runner", self.runner, str)
        _need("balancer", "decisions", self.decisions, list)
        _need("balancer", "view", self.view, dict)
        _need("balancer", "problems", self.problems, list)


@dataclass
class HelperStatus(Record):
    """What a PostMan helper's agent reports (services/memcached-helper/agent.py), under the lease of the
    helper's endpoint: ``serves`` the service address it answers for (ip:port), ``pid`` its fast path's,
    ``stats`` numbers from its stats file (S, T, batches, keys, drops, ...), ``at`` when they were read.
    ``down``: why it does not serve now (its leg to memcached stalled, ...); such a record is written without
    the lease, after the endpoint was withdrawn, so operators see the reason (issue 43)."""

    KIND: ClassVar[str] = "helper"
    at: float
    serves: str = ""
    pid: int = 0
    stats: dict = field(default_factory=dict)
    down: str = ""

    def __post_init__(self) -> None:
        _need("helper", "down", self.down, str)
        _need("helper", "at", self.at, (int, float))
        _need("helper", "serves", self.serves, str)
        _need("helper", "pid", self.pid, int)
        _need("helper", "stats", self.stats, dict)


HOLD_WHAT = ("on", "off")


@dataclass
class Holds(Record):
    """Ranges of a service whose helpers an operator set by hand ('vfab helpers on|off'): the balancer leaves
    their helpers alone until 'vfab helpers auto' hands them back.  ``holds``: disjoint [lo, hi, what, at]
    rows by lo, ``what`` the command ("on" or "off"), ``at`` when (unix s).  Kept apart from the range
    records, so a hold outlives the splits, merges and re-routes of the ranges under it."""

    KIND: ClassVar[str] = "holds"
    holds: list = field(default_factory=list)

    def __post_init__(self) -> None:
        _need("holds", "holds", self.holds, list)
        last = -1
        for row in self.holds:
            if not (isinstance(row, list) and len(row) == 4):
                raise VidError(f"hold {row!r} is not [lo, hi, what, at]")
            lo, hi, what, at = row
            for name, v in (("lo", lo), ("hi", hi)):
                _need("hold", name, v, int)
            if not last < lo <= hi <= KEY_MAX:
                raise VidError(f"hold [{lo}, {hi}] is out of order or outside the key space 0..{KEY_MAX:#x}")
            if what not in HOLD_WHAT:
                raise VidError(f"hold what={what!r}: one of {', '.join(HOLD_WHAT)}")
            _need("hold", "at", at, (int, float))
            last = hi

    def ranges(self) -> list[tuple[Range, str, float]]:
        return [(Range(lo, hi), what, at) for lo, hi, what, at in self.holds]


ENCAPS = ("geneve", "vxlan")
TUNNEL_KEY_MAX = (1 << 24) - 1    # Geneve's and VXLAN's 24-bit VNI


def check_tunnel_ip(ip: Any, what: str = "tunnel address") -> str:
    """``ip`` as a normalised unicast IPv4 address, or a VidError saying why it cannot carry tunnels."""
    try:
        if not isinstance(ip, str):
            raise TypeError(ip)
        addr = ipaddress.IPv4Address(ip)
    except (ValueError, TypeError):
        raise VidError(f"{what} {ip!r} is not an IPv4 address (dotted quad, e.g. 172.16.45.1; IPv6 underlays "
                       "are not supported yet)") from None
    if addr.is_loopback or addr.is_multicast or addr.is_unspecified or addr.is_link_local or \
            str(addr) == "255.255.255.255":
        raise VidError(f"{what} {addr} cannot carry tunnels: it is a loopback, multicast, link-local, broadcast "
                       "or unspecified address; give the address of this host on the underlay network")
    return str(addr)


@dataclass
class Node(Record):
    """A fabric host: its Open vSwitch integration bridge ``bridge`` (datapath id ``dpid``) reached through
    tunnels (``encap``, VNI ``key``) to ``tunnel_ip``.  ``ports``: the bridge's own ports (name -> OpenFlow port
    number; tunnels left out); ``peers``: the nodes its agent has built a tunnel to; ``joined``: when (unix s);
    ``agent``: which process keeps it (``pid@hostname``); ``refused``: tunnel packets from addresses that are no
    node's its filter dropped.  Leased by that agent: its lease is the node's
    liveness."""
    KIND: ClassVar[str] = "node"
    name: str
    tunnel_ip: str
    dpid: int
    bridge: str
    encap: str = "geneve"
    key: int = 0
    ports: dict = field(default_factory=dict)
    peers: list = field(default_factory=list)
    joined: float = 0.0
    agent: str = ""
    refused: int = 0      # tunnel packets its underlay filter dropped (from addresses that are no node's)

    def __post_init__(self) -> None:
        check_name("node", self.name)
        self.tunnel_ip = check_tunnel_ip(self.tunnel_ip, f"node {self.name}: tunnel address")
        _need("node", "dpid", self.dpid, int)
        _need("node", "bridge", self.bridge, str)
        if self.encap not in ENCAPS:
            raise VidError(f"node {self.name}: encapsulation {self.encap!r} is unknown: one of {', '.join(ENCAPS)}")
        _need("node", "key", self.key, int)
        if not 0 <= self.key <= TUNNEL_KEY_MAX:
            raise VidError(f"node {self.name}: tunnel key {self.key} is out of range: 0..{TUNNEL_KEY_MAX}")
        _need("node", "ports", self.ports, dict)
        for port, num in self.ports.items():
            if not isinstance(port, str) or not isinstance(num, int) or isinstance(num, bool):
                raise VidError(f"node {self.name}: port {port!r}: {num!r} is not a name and an OpenFlow port number")
        _need("node", "peers", self.peers, list)
        for peer in self.peers:
            check_name("node peer", peer)
        _need("node", "joined", self.joined, (int, float))
        _need("node", "agent", self.agent, str)
        _need("node", "refused", self.refused, int)


# -- issue 45 (5): what the balancer reads instead of other hosts' sockets and files; its election ----------------
def usage_prefix(service: str = "") -> str:
    """``usage/`` (every service's reports) or ``usage/<service>/``."""
    return f"{ROOT}usage/{service}/" if service else f"{ROOT}usage/"


def usage_key(service: str, endpoint: str) -> str:
    return f"{ROOT}usage/{check_name('service', service)}/{check_name('endpoint', endpoint)}"


def leader_key(role: str, scope: str) -> str:
    """Who is the active ``role`` (e.g. "balancer") for ``scope`` (e.g. a service): one key, one holder."""
    return f"{ROOT}leaders/{check_name('role', role)}/{check_name('scope', scope)}"


@dataclass
class Usage(Record):
    """An endpoint's own load, written by a reporter on its host (memcached: its agent polls ``stats`` locally):
    ``cpu`` CPU seconds per second, ``served`` requests per second, both over the last ``window`` s before
    ``at`` (the reporter's wall clock when it read the counters); ``cores`` the threads serving.  ``every``: the
    reporter writes at least this often (more often when the numbers move), so a record older than that by
    more than a margin means a reporter that stopped or a clock that differs.  ``error``: why the counters
    could not be read (then the numbers mean nothing).  Leased by the reporter (with the endpoint's lease when
    it is the endpoint's own agent)."""

    KIND: ClassVar[str] = "usage"
    at: float
    cpu: float = 0.0
    served: float = 0.0
    cores: float = 1.0
    window: float = 0.0
    every: float = 0.0
    source: str = ""
    error: str = ""

    def __post_init__(self) -> None:
        for n in ("at", "cpu", "served", "cores", "window", "every"):
            _need("usage", n, getattr(self, n), (int, float))
        for n in ("cpu", "served", "window", "every"):
            if getattr(self, n) < 0:
                raise VidError(f"usage field {n!r} is negative: {getattr(self, n)!r}")
        if not self.cores > 0:
            raise VidError(f"usage field 'cores' must be above 0: {self.cores!r}")
        _need("usage", "source", self.source, str)
        _need("usage", "error", self.error, str)

    def age(self, now: float) -> float:
        """s since the counters were read (never below 0: a reporter's clock ahead of ours is not staleness)."""
        return max(0.0, now - self.at)

    def stale(self, now: float, limit: float) -> bool:
        """Too old to decide on: older than ``limit`` s (the balancer's ``stale_after``)."""
        return self.age(now) > limit


@dataclass
class Leader(Record):
    """The holder of an election (``leader_key``): ``who`` (hostname:pid), ``since`` when it won (unix s),
    ``lease`` the lease the key lives under.  Its key's create revision is the holder's fencing token: a write
    it makes compares it in the same transaction, so a holder that lost the key (paused past its lease, cut
    off) can no longer write."""

    KIND: ClassVar[str] = "leader"
    who: str
    since: float
    lease: int = 0

    def __post_init__(self) -> None:
        _need("leader", "who", self.who, str)
        if not self.who:
            raise VidError("leader field 'who' is empty: name the process (hostname:pid)")
        _need("leader", "since", self.since, (int, float))
        _need("leader", "lease", self.lease, int)


# Folders that never change what the controller compiles (its own reports, endpoints' ops and load, the
# balancer's status: its decisions reach the switches through the ranges it writes).
PASSIVE = ("applied", "counters", "ops", "load", "balancer", "helpers", "holds", "nodes", "node-ips", "route-agents",
           "usage", "leaders", "sdhcp")


def parse_key(key: str) -> tuple[str, list[str]] | None:
    """('ranges', [service, lo]) etc. for a key under ROOT; None if foreign."""
    if not key.startswith(ROOT):
        return None
    parts = key[len(ROOT):].split("/")
    return parts[0], parts[1:]


def records(items: dict[str, tuple[bytes, int]], rec_type: type[Record]) -> list[tuple[str, Any, int]]:
    """(key, record, mod revision) of every well-formed ``rec_type`` record among ``items`` (a
    ``Registry.get_prefix`` answer); a malformed one is skipped: one bad record must not hide the others."""
    out = []
    for key, (raw, rev) in items.items():
        try:
            out.append((key, rec_type.from_json(raw, key), rev))
        except RegistryError:
            continue
    return out


# Which record type lives under which top-level folder.
RECORDS: dict[str, type[Record]] = {
    "services": Service,
    "endpoints": Endpoint,
    "ranges": RangeRec,
    "hosts": Host,
    "bindings": Binding,
    "switches": Switch,
    "links": Link,
    "applied": Applied,
}


# -- metrics targets (issue 46) ------------------------------------------------------------------------------------
#    /vfab/v1/metrics/<process>/<service|->/<name>   MetricsTarget {process, name, addr, service, host, pid, at}
#                                         where a process's Prometheus exporter listens, leased by it
#                                         (vfab.vid.metrics); "-" for a process of no one service
METRICS_PROCESSES = ("controller", "endpoint", "helper", "balancer", "agent")
FOLDERS = (*FOLDERS, "metrics")
PASSIVE = (*PASSIVE, "metrics")


def metrics_prefix() -> str:
    return f"{ROOT}metrics/"


def metrics_key(process: str, name: str, service: str = "") -> str:
    """Endpoint names are unique within their service only: the service is part of the key."""
    if process not in METRICS_PROCESSES:
        raise VidError(f"metrics process kind {process!r} is unknown: one of {', '.join(METRICS_PROCESSES)}")
    if service:
        check_name("service", service)
    return f"{ROOT}metrics/{process}/{service or '-'}/{check_name('metrics target', name)}"


@dataclass
class MetricsTarget(Record):
    """A process's Prometheus exporter: ``addr`` HOST:PORT serving ``/metrics``; ``process`` its kind
    (METRICS_PROCESSES), ``name`` which one (an endpoint's name, a controller's host, ...), ``service`` the
    service it serves ("" if none), ``host`` the machine, ``pid``, ``at`` when it started (unix s)."""

    KIND: ClassVar[str] = "metrics target"
    process: str
    name: str
    addr: str
    service: str = ""
    host: str = ""
    pid: int = 0
    at: float = 0.0

    def __post_init__(self) -> None:
        if self.process not in METRICS_PROCESSES:
            raise VidError(f"metrics target process {self.process!r} is unknown: one of {', '.join(METRICS_PROCESSES)}")
        check_name("metrics target", self.name)
        _need("metrics target", "addr", self.addr, str)
        host, sep, port = self.addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise VidError(f"metrics target {self.name}: address {self.addr!r} is not HOST:PORT")
        _need("metrics target", "service", self.service, str)
        if self.service:
            check_name("service", self.service)
        _need("metrics target", "host", self.host, str)
        _need("metrics target", "pid", self.pid, int)
        _need("metrics target", "at", self.at, (int, float))
