"""The echo service's plug-in declaration (``vfab.vid.plugin``): stateless, JSON payloads, no front door."""

from vfab.vid.plugin import ServicePlugin, register

PLUGIN = register(ServicePlugin(
    kind="echo",
    summary="answers every request with the server's name (tests, demos, benchmarks); stateless",
    wire="vfab.services.echo.server",
))
