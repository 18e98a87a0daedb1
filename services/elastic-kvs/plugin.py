"""elastic-KVS's plug-in declaration (``vfab.vid.plugin``): everything vfab needs to know of it, in one place."""

from vfab.vid.plugin import ServicePlugin, register

PLUGIN = register(ServicePlugin(
    kind="elastic-kvs",
    summary="persistent key-value store; its ranges split, merge, move and mirror live with their data",
    wire="vfab.services.elastic_kvs.proto",
    key_of="vfab.services.elastic_kvs.proto:key_of",
    backend="vfab.services.elastic_kvs.backend:open_backend",
    cli="vfab.cli.cmd_kvs:kvs",
))
