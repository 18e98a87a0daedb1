"""Front doors: table-0 classifiers that turn a real protocol into a service's VIDs.

A front door is a function ``(ctx) -> list[FlowSpec]`` registered under a name;
a service opts in by naming it in its record.  Services of later issues
(sdhcp: DHCP → VID from the client MAC; memcached UDP → VID) plug in here.
"""

from __future__ import annotations

from typing import Callable

from vfab.fabric.flows import FlowSpec

FrontDoor = Callable[..., list[FlowSpec]]
REGISTRY: dict[str, FrontDoor] = {}


def register(name: str) -> Callable[[FrontDoor], FrontDoor]:
    def deco(fn: FrontDoor) -> FrontDoor:
        REGISTRY[name] = fn
        return fn
    return deco
