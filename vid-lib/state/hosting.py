"""What the endpoint loop's collaborators may ask of it: one narrow interface each (issue 47).

An operation's runner (``runner.OpRunner``) and the housekeeper (``housekeeper.Housekeeper``) run beside the
loop in threads of their own and reach it only through these members; ``loop.EndpointLoop`` provides them.
Declared here rather than by importing the loop, so neither collaborator depends on the loop's module (the
loop imports them, never the other way round; ``scripts/check_layers.py`` keeps it so).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

import zmq

from vfab.vid.ranges import Range
from vfab.vid.registry import schema
from vfab.vid.state.backend import Backend
from vfab.vid.state.lease import EndpointLease
from vfab.vid.state.view import View

T = TypeVar("T")


class LoopCalls(Protocol):
    name: str                  # the endpoint's name
    service: schema.Service    # its service's record
    etcd: str                  # the etcd member list it uses
    backend: Backend

    def call(self, fn: Callable[[], T], wait: bool = True, timeout: float = 10.0) -> T:
        """Run ``fn`` on the loop's thread (between two batches) and return its result."""
        ...


@runtime_checkable
class OperationHost(LoopCalls, Protocol):
    """What a state operation's runner needs of the loop it runs in (the source endpoint)."""

    zctx: zmq.Context
    lease: EndpointLease
    view: View

    def op_command(self, op: Any, cmd: str, rng: Range, to: str, rec: Any, revision: int = 0) -> Any: ...

    def op_ended(self, op: Any) -> None: ...

    def op_recorded(self, op_id: str) -> None: ...

    def forget(self, rng: Range) -> None: ...


@runtime_checkable
class HousekeepingHost(LoopCalls, Protocol):
    """What the housekeeper (dropping old copies, re-reading the view after a lost watch) needs of the loop."""

    def drops_pending(self) -> bool: ...

    def drop_step(self) -> tuple[bool, str, float]: ...

    def _set_view(self, view: View, generation: int | None = None) -> None: ...
