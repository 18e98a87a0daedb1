"""The node agent: keeps this machine registered as a fabric node and its tunnels matching the registry.

``vfab node join`` runs it in the foreground (systemd, or ``ip netns exec`` in the testbed).  It

1. checks the machine: the tunnel address is one of its own, held by an Open vSwitch bridge other than the
   integration bridge (the userspace datapath sends tunnel packets only through such a bridge: OVS's
   userspace-tunneling howto), the integration bridge exists (made if not);
2. registers the node under a lease it keeps alive (``vfab.vid.registry.nodes.join``): a name or tunnel
   address a live node holds is refused;
3. follows ``nodes/``: one tunnel port per other node, the underlay filter that admits tunnel packets only
   from registered nodes (``vfab.fabric.tunnels``); its record lists its ports, its peers and how many
   foreign tunnel packets the filter dropped;
4. leaves when its record is deleted (``vfab node leave``): removes its tunnels and filter, revokes its lease.

Stopped (SIGTERM/SIGINT) it leaves its tunnels in place, so the data plane keeps forwarding while it
restarts; its lease ends ``ttl`` s later unless a restarted agent takes it back (the lease id is kept in
``state_dir``).  ``vfab node leave`` drains the node's ranges before it deletes the records
(``vfab.controller.drain``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
import time

from vfab.fabric import ovs, tunnels
from vfab.vid.errors import Conflict, RegistryError, VfabError
from vfab.vid.registry import Registry, nodes, schema

log = logging.getLogger("vfab.node")
STATE_DIR = os.environ.get("VFAB_NODE_STATE_DIR", "/var/lib/vfab/node")


class NodeError(VfabError):
    pass


def address_device(ip: str) -> str | None:
    """The interface of this network namespace that holds IPv4 address ``ip`` (None: none does)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts and parts[parts.index("inet") + 1].split("/")[0] == ip:
            return parts[1].split("@")[0]
    return None


def local_addresses() -> list[str]:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    return [p[p.index("inet") + 1] for p in (ln.split() for ln in out.splitlines()) if "inet" in p]


def next_hop(ip: str) -> tuple[str, str] | None:
    """(the neighbour a packet to ``ip`` goes to first, its interface), by this namespace's routes."""
    out = subprocess.run(["ip", "-j", "route", "get", ip], capture_output=True, text=True).stdout
    try:
        route = json.loads(out)[0]
        return route.get("gateway", ip), route["dev"]
    except (ValueError, IndexError, KeyError, TypeError):
        return None


def neighbour_mac(ip: str, dev: str) -> str:
    out = subprocess.run(["ip", "-j", "neigh", "show", "to", ip, "dev", dev], capture_output=True, text=True).stdout
    try:
        return next((n["lladdr"] for n in json.loads(out) if n.get("lladdr")), "")
    except (ValueError, TypeError):
        return ""


def prime_neighbours(ips: list[str], wait: float = 1.0) -> int:
    """Give the userspace datapath the next hop of each of ``ips`` now; how many it got.

    The datapath learns a tunnel's next hop only by snooping ARP *replies* on the underlay bridge, and drops
    what it cannot send meanwhile: the first frame into a new tunnel was lost.  The kernel may never send a
    request of its own (it learns a peer from the peer's request), so a ping alone does not do: each peer is
    pinged once (all at once, at most ``wait`` s) so the kernel resolves its next hop, and the address the
    kernel holds for it is handed to OVS (``tnl/neigh/set``).
    """
    pings = [subprocess.Popen(["ping", "-n", "-q", "-c", "1", "-W", str(max(1, int(wait))), ip],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for ip in ips]
    for p in pings:
        try:
            p.wait(wait + 1)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    done = 0
    for ip in ips:
        hop = next_hop(ip)
        mac = neighbour_mac(*hop) if hop else ""
        if not mac:
            log.warning("next hop of %s unknown (no ARP answer): the first frames into its tunnel may be lost",
                        ip)
            continue
        try:
            ovs.appctl("tnl/neigh/set", hop[1], hop[0], mac)
            done += 1
        except ovs.OvsError as exc:
            log.warning("cannot give OVS the next hop of %s: %s", ip, exc)
    return done


class NodeAgent:
    def __init__(self, reg: Registry, name: str, tunnel_ip: str, bridge: str, *, ttl: int = 5,
                 refresh: float = 2.0, state_dir: str | None = None):
        self.reg = reg
        self.name = schema.check_name("node", name)
        self.tunnel_ip = schema.check_tunnel_ip(tunnel_ip)
        self.bridge = bridge
        self.ttl = ttl
        self.refresh = refresh
        self.state_path = os.path.join(state_dir or STATE_DIR, f"{self.name}.json")
        self.phy = ""
        self.dpid = 0
        self.lease = 0
        self.record: schema.Node | None = None
        self.view: dict[str, schema.Node] = {}
        self.dirty = threading.Event()
        self.filtered: list[str] | None = None    # peer addresses the filter admits now (None: not set yet)
        self.warned: set[str] = set()
        self.left = False
        self.unreachable = False   # the last lease renewal could not reach etcd
        self.on_joined = lambda: None   # called once registered (the CLI says so)
        self.join_rev = 0          # the revision of this agent's registration
        self.gone_rev = 0          # the revision at which the record was seen deleted after it (a leave)

    # -- 1. the machine ----------------------------------------------------------------
    def check_machine(self) -> None:
        try:
            ovs.vsctl("show", timeout=3)
        except ovs.OvsError as exc:
            where = os.environ.get("OVS_RUNDIR", "/var/run/openvswitch")
            raise NodeError(f"Open vSwitch is not reachable through {where}/db.sock ({exc}): start it, or point "
                            "--ovs-rundir (OVS_RUNDIR) at its run directory") from None
        dev = address_device(self.tunnel_ip)
        if dev is None:
            have = ", ".join(local_addresses()) or "none"
            raise NodeError(f"tunnel address {self.tunnel_ip} is not an address of this machine (its IPv4 "
                            f"addresses: {have}): give --tunnel-ip the address this host has on the underlay")
        if dev == self.bridge:
            raise NodeError(f"tunnel address {self.tunnel_ip} sits on the integration bridge {self.bridge}: put it "
                            "on an underlay bridge of its own (e.g. br-phy holding the underlay NIC), as in OVS's "
                            "userspace-tunneling howto")
        bridges = ovs.bridges()
        if dev not in bridges:
            raise NodeError(f"tunnel address {self.tunnel_ip} sits on {dev}, which is not an Open vSwitch bridge: "
                            "the userspace datapath sends tunnel packets only through a netdev bridge that holds "
                            f"the address and the underlay port (move the address to such a bridge: 'ovs-vsctl "
                            f"add-br br-phy -- set bridge br-phy datapath_type=netdev -- add-port br-phy {dev}', "
                            "then the address onto br-phy)")
        self.phy = dev
        if self.bridge not in bridges:
            dp = ovs.vsctl("get", "bridge", dev, "datapath_type").strip('"') or "system"
            log.info("node %s: creating the integration bridge %s (datapath %s, fail mode secure)", self.name,
                     self.bridge, dp)
            ovs.add_bridge(self.bridge, datapath=dp, fail_mode="secure")
        self.dpid = int(ovs.vsctl("get", "bridge", self.bridge, "datapath_id").strip('"'), 16)

    # -- 2. registration ------------------------------------------------------------------
    def _saved_lease(self) -> int:
        try:
            with open(self.state_path) as fh:
                data = json.load(fh)
            return int(data["lease"]) if data.get("tunnel_ip") == self.tunnel_ip else 0
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def _save_lease(self) -> None:
        os.makedirs(os.path.dirname(self.state_path), exist_ok=True)
        tmp = self.state_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"lease": self.lease, "tunnel_ip": self.tunnel_ip}, fh)
        os.replace(tmp, self.state_path)

    def build_record(self, peers: list[str] | None = None, refused: int | None = None) -> schema.Node:
        old = self.record
        return schema.Node(name=self.name, tunnel_ip=self.tunnel_ip, dpid=self.dpid, bridge=self.bridge,
                           encap=tunnels.ENCAP, key=tunnels.FABRIC_VNI, ports=tunnels.local_ports(self.bridge),
                           peers=sorted(peers if peers is not None else (old.peers if old else [])),
                           joined=old.joined if old else time.time(), agent=f"{os.getpid()}@{socket.gethostname()}",
                           refused=refused if refused is not None else (old.refused if old else 0))

    def join(self) -> None:
        mine = self.build_record()
        for other in nodes.nodes(self.reg).values():
            why = tunnels.mismatched(mine, other) if other.name != self.name else ""
            if why:
                log.warning("node %s: %s", self.name, why)
        saved = self._saved_lease()
        if saved and self.reg.keepalive_once(saved) > 0:
            self.lease = saved
            self.record = self.build_record()
            try:
                self.join_rev = nodes.join(self.reg, self.record, self.lease, retake=True)
                log.info("node %s: took its registration back (lease %x, kept over the restart)", self.name, saved)
                return
            except Conflict:
                self.revoke_quietly(saved)
        self.lease = self.reg.lease(self.ttl)
        self.record = self.build_record()
        try:
            self.join_rev = nodes.join(self.reg, self.record, self.lease)
        except Conflict:
            self.revoke_quietly(self.lease)
            self.lease = 0
            raise
        self._save_lease()
        log.info("node %s: joined (tunnel address %s, bridge %s dpid %016x, underlay bridge %s, lease %x, %d s)",
                 self.name, self.tunnel_ip, self.bridge, self.dpid, self.phy, self.lease, self.ttl)

    def revoke_quietly(self, lease: int) -> None:
        try:
            self.reg.revoke(lease)
        except RegistryError:
            pass

    # -- 3. following the other nodes ---------------------------------------------------------
    def _reset(self, items: dict, revision: int) -> None:
        view = {}
        for key, (raw, _) in items.items():
            try:
                n = schema.Node.from_json(raw, key)
            except RegistryError as exc:
                log.warning("%s", exc)
                continue
            view[n.name] = n
        if self.name not in view and revision > self.join_rev:
            self.gone_rev = revision
        self.view = view
        self.dirty.set()

    def _apply(self, batch) -> None:
        view = dict(self.view)
        for ev in batch:
            name = ev.key.rsplit("/", 1)[-1]
            if ev.value is None:
                view.pop(name, None)
                if name == self.name and ev.revision > self.join_rev:
                    self.gone_rev = ev.revision
                continue
            try:
                view[name] = schema.Node.from_json(ev.value, ev.key)
            except RegistryError as exc:
                log.warning("%s", exc)
        self.view = view
        self.dirty.set()

    def reconcile(self) -> None:
        view = dict(self.view)
        me = self.record
        for other in view.values():
            why = tunnels.mismatched(me, other) if other.name != me.name else ""
            if why and other.name not in self.warned:
                self.warned.add(other.name)
                log.warning("node %s: %s", self.name, why)
        want = tunnels.wanted(me, view)
        have = tunnels.current(self.bridge)
        add, remove = tunnels.plan(want, have)
        peers_ips = sorted(t.remote_ip for t in want.values())
        if remove:
            tunnels.apply_ports(self.bridge, [], remove)
        if peers_ips != self.filtered and self.phy:
            tunnels.apply_filter(self.phy, tunnels.filter_flows(self.tunnel_ip, peers_ips, me.encap))
            self.filtered = peers_ips
        if add:
            tunnels.apply_ports(self.bridge, add, [])
            prime_neighbours([t.remote_ip for t in add])
        for t in add:
            log.info("node %s: tunnel %s to node %s at %s", self.name, t.name, t.peer, t.remote_ip)
        for name in remove:
            log.info("node %s: tunnel %s removed (%s)", self.name, name, have[name].peer or "no node")
        self.publish(sorted(t.peer for t in want.values()))

    def publish(self, peers: list[str] | None = None) -> None:
        """Rewrite this node's record if its ports, peers or refused count changed."""
        refused = tunnels.dropped(self.phy) if self.phy else 0
        if self.record is not None and refused > self.record.refused:
            log.warning("node %s: dropped %d tunnel packet(s) from addresses that are no fabric node's (%d in "
                        "all; 'ovs-ofctl dump-flows %s' shows the filter)", self.name,
                        refused - self.record.refused, refused, self.phy)
        rec = self.build_record(peers, refused)
        if rec == self.record:
            return
        if nodes.update(self.reg, rec, self.lease):
            self.record = rec

    # -- the loop -------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Join, then follow until ``stop`` is set (keep the registration) or the record is deleted (leave)."""
        self.join()
        self.on_joined()
        follower = threading.Thread(
            target=self.reg.follow, name="node-follow", daemon=True,
            args=(schema.folder("nodes"), self._reset, self._apply, stop),
            kwargs={"idle": self.refresh, "on_error": lambda exc, first: first and log.warning(
                "node %s: etcd: %s; retrying", self.name, exc)})
        follower.start()
        beat = max(self.ttl / 3.0, 0.2)
        next_beat = next_refresh = 0.0
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + beat
                    if not self._keepalive():
                        continue
                if self.gone_rev > self.join_rev:
                    if self._lease_alive():     # deleted, not expired: 'vfab node leave'
                        self.leave_local()
                        return
                    self.gone_rev = 0           # expired: _keepalive registers again
                if self.dirty.is_set() or now >= next_refresh:
                    self.dirty.clear()
                    next_refresh = now + self.refresh
                    try:
                        self.reconcile()
                    except (VfabError, RegistryError) as exc:   # again at the next refresh, not in a spin
                        log.warning("node %s: reconcile failed: %s; retrying in %g s", self.name, exc,
                                    self.refresh)
                self.dirty.wait(min(beat, self.refresh) / 2)
        finally:
            stop.set()

    def _lease_alive(self) -> bool:
        try:
            return self.reg.keepalive_once(self.lease) > 0
        except RegistryError:
            return False

    def _keepalive(self) -> bool:
        """Renew the lease; re-register when etcd let it end (this agent was starved, or etcd lost it)."""
        try:
            if self.reg.keepalive_once(self.lease) > 0:
                if self.unreachable:
                    log.warning("node %s: etcd reachable again", self.name)
                self.unreachable = False
                return True
        except RegistryError as exc:
            if not self.unreachable:   # once per outage, not once per beat
                log.warning("node %s: lease renewal failed: %s; retrying every %.1f s", self.name, exc,
                            max(self.ttl / 3.0, 0.2))
            self.unreachable = True
            return False
        self.unreachable = False
        log.warning("node %s: its lease %x ended (the agent was starved past %d s?): registering again",
                    self.name, self.lease, self.ttl)
        try:
            self.record = None
            self.join()
            self.dirty.set()
        except (Conflict, RegistryError) as exc:
            log.error("node %s: cannot register again: %s", self.name, exc)
            return False
        return True

    def leave_local(self) -> None:
        """This node's record was deleted ('vfab node leave'): take its tunnels and filter down, end the lease."""
        have = tunnels.current(self.bridge)
        tunnels.apply_ports(self.bridge, [], sorted(have))
        if self.phy:
            tunnels.apply_filter(self.phy, [])
        self.revoke_quietly(self.lease)
        try:
            os.unlink(self.state_path)
        except FileNotFoundError:
            pass
        self.left = True
        log.info("node %s: left the fabric (%d tunnels removed)", self.name, len(have))
