"""The memcached service type's plug-in declaration (``vfab.vid.plugin``).

A service of kind ``memcached`` is an unmodified memcached reached over UDP at ``--opt ip=ADDRESS`` (port
11211): its front door turns that UDP into the service's VIDs keyed by the client's IPv4 address, so ranges
of clients can be steered to PostMan helpers (``vfab helpers``) without any client changing anything.
"""

from vfab.vid.plugin import ServicePlugin, register

PLUGIN = register(ServicePlugin(
    kind="memcached",
    summary="unmodified memcached over UDP; PostMan helpers coalesce its clients' gets when switched in",
    wire="vfab.services.memcached_helper.mcudp",
    frontdoors=({"kind": "udp", "ip": "{ip}", "port": 11211, "key": "ip_src"},),
    options={"ip": "the IPv4 address memcached's clients send to (its host's address)"},
))
