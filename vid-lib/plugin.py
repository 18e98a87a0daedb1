"""The service plug-in contract: everything a service type declares about itself, in one place.

A service type (elastic-KVS, echo, sdhcp, the memcached helper, ...) gives one
:class:`ServicePlugin`, registered under its ``kind``::

    PLUGIN = ServicePlugin(
        kind="elastic-kvs",
        summary="persistent key-value store; ranges split, merge, move and mirror with their state",
        wire="vfab.services.elastic_kvs.proto",             # the one module that knows its wire format
        key_of="vfab.services.elastic_kvs.proto:key_of",    # payload -> 24-bit VID key
        backend="vfab.services.elastic_kvs.backend:open_backend",   # (datadir, name) -> state Backend
        cli="vfab.cli.cmd_kvs:kvs",                         # its 'vfab <group>' commands
        frontdoors=(),                                      # table-0 classifiers its records get
    )

Code is named by ``"module:attribute"`` strings and imported only when used,
so listing the plug-ins (``vfab service add --help``) loads no service code.
``frontdoors`` are the records a new service of this kind gets in etcd
(``Service.frontdoors``; the kinds of front door and their parameters are
``vfab.fabric.frontdoor``'s); ``{param}`` in a string value is filled from the
options given to ``vfab service add --opt param=value``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from vfab.vid.errors import VidError
from vfab.vid.registry import schema

BUILTIN = ("vfab.services.echo.plugin", "vfab.services.elastic_kvs.plugin")


@dataclass(frozen=True)
class ServicePlugin:
    kind: str
    summary: str
    wire: str
    key_of: str | None = None
    backend: str | None = None
    cli: str | None = None
    frontdoors: tuple = ()
    options: dict = field(default_factory=dict)   # option name -> what it means (for --help and errors)

    def __post_init__(self) -> None:
        schema.check_name("service kind", self.kind)

    @property
    def stateful(self) -> bool:
        return self.backend is not None

    def resolve(self, what: str) -> Any:
        """Import what ``self.<what>`` names ("module:attribute"; a module for ``wire``)."""
        ref = getattr(self, what)
        if ref is None:
            raise VidError(f"service kind {self.kind!r} has no {what}")
        module, _, attr = ref.partition(":")
        mod = importlib.import_module(module)
        return getattr(mod, attr) if attr else mod

    def service_frontdoors(self, opts: dict[str, str]) -> list[dict]:
        """The front-door records of a new service of this kind, with ``{param}``s filled from ``opts``."""
        unknown = sorted(set(opts) - set(self.options))
        if unknown:
            known = ", ".join(f"{k} ({v})" for k, v in self.options.items()) or "none"
            raise VidError(f"service kind {self.kind!r} takes no option {', '.join(unknown)}: its options are "
                           f"{known}")
        out = []
        for door in self.frontdoors:
            rec = {}
            for k, v in door.items():
                if isinstance(v, str) and v.startswith("{") and v.endswith("}"):
                    name = v[1:-1]
                    if name not in opts:
                        raise VidError(f"service kind {self.kind!r} needs --opt {name}=... ({self.options[name]})")
                    v = int(opts[name]) if opts[name].isdigit() else opts[name]
                rec[k] = v
            out.append(rec)
        return out


_PLUGINS: dict[str, ServicePlugin] = {}


def register(plugin: ServicePlugin) -> ServicePlugin:
    if plugin.kind in _PLUGINS and _PLUGINS[plugin.kind] != plugin:
        raise VidError(f"service kind {plugin.kind!r} is registered twice")
    _PLUGINS[plugin.kind] = plugin
    return plugin


def load() -> dict[str, ServicePlugin]:
    """Every known plug-in (the built-in ones are imported on first use)."""
    for module in BUILTIN:
        importlib.import_module(module)
    return dict(_PLUGINS)


def get(kind: str) -> ServicePlugin:
    plugins = load()
    if kind not in plugins:
        raise VidError(f"service kind {kind!r} is unknown: one of {', '.join(sorted(plugins))}")
    return plugins[kind]
