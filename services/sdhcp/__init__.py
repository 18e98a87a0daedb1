"""sdhcp: the scalable DHCP service of vfab (DESIGN.md §1, issue 9).

Unmodified DHCPv4 clients (udhcpc, dhclient, dhcpcd) reach it through a front
door that steers ``udp,tp_dst=67`` by the client MAC's key (``vfab.vid.mackey``:
a hash of it, or its low 24 bits for a service created before) to the shard
owning that key range.  The protocol layer:

``wire``
    the DHCP/BOOTP message format (RFC 2131/2132, overload, RFC 3396 long
    options): ``parse``, ``Message``, ``Message.serialize``, typed accessors.
``reply``
    the server's reply rules: ``reply`` (OFFER/ACK/NAK builder),
    ``destination`` (RFC 2131 §4.1 addressing), ``reply_limit`` (option 57).
``ipudp``
    Ethernet + IPv4 + UDP framing with checksums, for raw sockets.
``errors``
    ``DhcpError``, the one exception the above raise for bad input.

The server: ``config`` (pool options), ``pool`` (which shard may hand out
which address), ``store`` (durable leases and their state records),
``backend`` (RFC 2131 on the stateful-endpoint loop), ``frames`` and ``port``
(DHCP and ARP on a shard's data port), ``server`` (``python -m
vfab.services.sdhcp server``), ``plugin`` and ``cli`` (``vfab sdhcp status``, ``vfab sdhcp rekey``).
See README.md.
"""
