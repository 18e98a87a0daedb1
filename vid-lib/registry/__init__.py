"""The fabric's registry in etcd: the key layout and records (``schema``) and the client (``etcd``).

Key names live in ``schema`` only; every read and write of etcd goes through
:class:`Registry`.
"""

from vfab.vid.registry.etcd import DEFAULT_ENDPOINT, Event, Registry

__all__ = ["DEFAULT_ENDPOINT", "Event", "Registry"]
