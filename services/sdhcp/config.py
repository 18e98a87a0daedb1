"""sdhcp's configuration: the pool and the options every shard of one service hands out.

The same ``NAME=VALUE`` options are read by ``vfab service add NAME --kind
sdhcp --opt NAME=VALUE`` (checked there) and by each shard's server
(``--opt NAME=VALUE``); every error says what is wrong, the limit and the fix.

=========  ========================================================  =========================
option     meaning                                                   default
=========  ========================================================  =========================
pool       first-last address handed out (``192.168.77.10-           required
           192.168.77.250``), inside the subnet
mask       subnet mask, dotted or a prefix length (``24``)           required
server     the one virtual server address (DHCP server identifier,   required
           option 54) shared by every shard; inside the subnet,
           outside the pool
router     default router(s) (option 3), comma-separated             none
dns        DNS server(s) (option 6), comma-separated                 none
lease      lease time in seconds (option 51)                         3600
t1         renewal time T1 in seconds (option 58)                    lease/2
t2         rebinding time T2 in seconds (option 59)                  lease*7/8
relays     relay agent addresses (giaddr) whose relayed requests     none: relayed requests are
           are served, comma-separated                               dropped and counted
=========  ========================================================  =========================

Shards of one service must agree on ``pool``, ``mask`` and ``server``: which
shard may offer an address follows from the pool (``pool.py``) and clients
renew at the server address.  :attr:`Config.fingerprint` digests those three;
every state record carries it and a shard refuses records of another pool
(``store.py``), so a split, move or mirror between shards configured apart
fails before anything is handed out twice.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network

from vfab.services.sdhcp.errors import DhcpError

MAX_LEASE = 0xFFFFFFFE          # 0xFFFFFFFF means "infinite" (RFC 2132 §9.2): not handed out
MIN_LEASE = 10                  # s; clients retry at T1 and T2, shorter leases only churn
MAX_POOL = 1 << 20              # addresses in one pool (a /12); each address is a row when used
MIN_PREFIX, MAX_PREFIX = 8, 30

OPTIONS = {
    "pool": "first-last address handed out, e.g. 192.168.77.10-192.168.77.250 (required)",
    "mask": "subnet mask, dotted or prefix length, e.g. 24 (required)",
    "server": "the virtual server address shared by all shards (DHCP server identifier; required)",
    "router": "default router(s), comma-separated",
    "dns": "DNS server(s), comma-separated",
    "lease": "lease time in seconds (default 3600)",
    "t1": "renewal time T1 in seconds (default lease/2)",
    "t2": "rebinding time T2 in seconds (default lease*7/8)",
    "relays": "relay agents (giaddr) whose relayed requests are served, comma-separated (default: none)",
}


def _ip(name: str, text: str) -> IPv4Address:
    try:
        return IPv4Address(text.strip())
    except ValueError:
        raise DhcpError(f"--opt {name}={text!r} is not an IPv4 address: write it like 192.168.77.1") from None


def _ips(name: str, text: str) -> tuple[IPv4Address, ...]:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise DhcpError(f"--opt {name}= is empty: give one or more addresses, comma-separated, or leave it out")
    if len(parts) > 8:
        raise DhcpError(f"--opt {name} lists {len(parts)} addresses: the limit is 8")
    return tuple(_ip(name, p) for p in parts)


def _seconds(name: str, text: str, lo: int, hi: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise DhcpError(f"--opt {name}={text!r} is not a whole number of seconds") from None
    if not lo <= value <= hi:
        raise DhcpError(f"--opt {name}={value} is out of range: it must be {lo}..{hi} seconds")
    return value


def _mask(text: str) -> int:
    t = text.strip().lstrip("/")
    if t.isdigit():
        prefix = int(t)
    else:
        try:
            prefix = IPv4Network(f"0.0.0.0/{t}").prefixlen
        except ValueError:
            raise DhcpError(f"--opt mask={text!r} is not a subnet mask: write 255.255.255.0 or 24") from None
    if not MIN_PREFIX <= prefix <= MAX_PREFIX:
        raise DhcpError(f"--opt mask={text!r} is a /{prefix}: the subnet must be /{MIN_PREFIX} to /{MAX_PREFIX}")
    return prefix


@dataclass(frozen=True)
class Config:
    first: IPv4Address
    last: IPv4Address
    prefix: int
    server: IPv4Address
    routers: tuple = ()
    dns: tuple = ()
    lease: int = 3600
    t1: int = 1800
    t2: int = 3150
    relays: tuple = ()
    opts: dict = field(default_factory=dict, compare=False)   # as given (for display)

    @property
    def network(self) -> IPv4Network:
        return IPv4Network(f"{self.server}/{self.prefix}", strict=False)

    @property
    def mask(self) -> IPv4Address:
        return self.network.netmask

    @property
    def size(self) -> int:
        return int(self.last) - int(self.first) + 1

    @property
    def fingerprint(self) -> int:
        """32 bits naming what shards must agree on (pool, subnet, server address)."""
        return zlib.crc32(f"{self.first}-{self.last}/{self.prefix}@{self.server}".encode())

    def describe(self) -> str:
        return f"pool {self.first}-{self.last} ({self.size} addresses) in {self.network}, server {self.server}"

    def to_opts(self) -> dict[str, str]:
        """The options that make this configuration again (stored with the leases)."""
        out = {"pool": f"{self.first}-{self.last}", "mask": str(self.prefix), "server": str(self.server),
               "lease": str(self.lease), "t1": str(self.t1), "t2": str(self.t2)}
        for name, ips in (("router", self.routers), ("dns", self.dns), ("relays", self.relays)):
            if ips:
                out[name] = ",".join(map(str, ips))
        return out


def parse_opts(opts: dict[str, str]) -> Config:
    """A Config from ``NAME=VALUE`` options; DhcpError names the option, the limit and the fix."""
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise DhcpError(f"sdhcp takes no option {', '.join(unknown)}: its options are "
                        + "; ".join(f"{k} ({v})" for k, v in OPTIONS.items()))
    for need in ("pool", "mask", "server"):
        if not opts.get(need, "").strip():
            raise DhcpError(f"sdhcp needs --opt {need}=... ({OPTIONS[need]})")
    first_s, sep, last_s = opts["pool"].partition("-")
    if not sep:
        raise DhcpError(f"--opt pool={opts['pool']!r} is not a range: write FIRST-LAST, "
                        "e.g. 192.168.77.10-192.168.77.250")
    first, last = _ip("pool", first_s), _ip("pool", last_s)
    if last < first:
        raise DhcpError(f"--opt pool={opts['pool']!r} runs backwards: write the lower address first")
    size = int(last) - int(first) + 1
    if size > MAX_POOL:
        raise DhcpError(f"--opt pool holds {size} addresses: the limit is {MAX_POOL}; use a smaller range")
    prefix = _mask(opts["mask"])
    server = _ip("server", opts["server"])
    net = IPv4Network(f"{server}/{prefix}", strict=False)
    for name, addr in (("pool start", first), ("pool end", last)):
        if addr not in net:
            raise DhcpError(f"the {name} {addr} is outside the subnet {net} of the server address: "
                            "give a pool inside it (or another --opt mask/server)")
    if first == net.network_address or last == net.broadcast_address:
        raise DhcpError(f"--opt pool={first}-{last} includes the network or broadcast address of {net}: "
                        f"start at {net.network_address + 1} or later and end at {net.broadcast_address - 1} "
                        "or earlier")
    if server in (net.network_address, net.broadcast_address):
        raise DhcpError(f"--opt server={server} is the network or broadcast address of {net}: pick a host address")
    if first <= server <= last:
        raise DhcpError(f"--opt server={server} lies inside the pool {first}-{last}: the server address is "
                        "never handed out; move it out of the pool")
    routers = _ips("router", opts["router"]) if "router" in opts else ()
    for r in routers:
        if r not in net or first <= r <= last:
            raise DhcpError(f"--opt router={r} must be inside {net} and outside the pool {first}-{last}")
    dns = _ips("dns", opts["dns"]) if "dns" in opts else ()
    relays = _ips("relays", opts["relays"]) if "relays" in opts else ()
    lease = _seconds("lease", opts.get("lease", "3600"), MIN_LEASE, MAX_LEASE)
    t1 = _seconds("t1", opts["t1"], 1, lease) if "t1" in opts else lease // 2
    t2 = _seconds("t2", opts["t2"], 1, lease) if "t2" in opts else lease * 7 // 8
    if not t1 < t2 < lease:
        raise DhcpError(f"T1 {t1} s, T2 {t2} s and the lease {lease} s must grow strictly (RFC 2131 §4.4.5): "
                        "set --opt t1 and t2 below --opt lease, t1 below t2")
    return Config(first, last, prefix, server, routers, dns, lease, t1, t2, relays, dict(opts))


def shard_config(given: dict[str, str], record: dict[str, str], service: str) -> Config | None:
    """The configuration a shard starts with: the service record's options ('vfab service add NAME --kind
    sdhcp --opt ...') with the shard's own ``--opt`` over them, or None when neither gives any (the one its
    store was created with: a restarted shard).  ``--opt`` may change what each shard hands out (lease,
    t1, t2, router, dns, relays), never the pool, mask or server the record names."""
    rec = None
    if record:
        try:
            rec = parse_opts(record)
        except DhcpError as exc:
            raise DhcpError(f"service {service}'s record holds options that are no valid pool ({exc}): delete and "
                            "add the service again with good ones") from None
    if not given:
        return rec
    mine = parse_opts({**record, **given})
    if rec is not None and mine.fingerprint != rec.fingerprint:
        raise DhcpError(f"--opt gives {mine.describe()} but service {service}'s record says {rec.describe()}: "
                        "every shard of a service hands out the one pool; leave --opt pool, mask and server out "
                        "to take the record's")
    return mine
