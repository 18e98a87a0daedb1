"""Shared CLI plumbing: the context object, parameter types, tables, error mapping."""

from __future__ import annotations

import functools
import json
import os
import sys

import click
from rich.console import Console
from rich.table import Table

from vfab.vid import codec
from vfab.vid.errors import Conflict, NotFound, RegistryError, VfabError, VidError
from vfab.vid.ranges import Range
from vfab.vid.registry import DEFAULT_ENDPOINT, Registry
from vfab.vid.registry import members as etcd_members

STATE_DIR = os.environ.get("VFAB_STATE_DIR", "/run/vfab")
STATE_FILE = os.path.join(STATE_DIR, "up.json")


def read_state() -> dict | None:
    try:
        with open(STATE_FILE) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


class Ctx:
    def __init__(self, etcd: str | None):
        state = read_state()
        self.etcd = etcd or (state or {}).get("etcd") or DEFAULT_ENDPOINT
        self._registry: Registry | None = None
        # Tables wider than 80 columns when piped (rich would otherwise wrap them to 80).
        self.console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = Registry(self.etcd)
        return self._registry


pass_ctx = click.make_pass_decorator(Ctx)


def etcd_list(ctx, param, value):
    """``--etcd``: a list of members (bad input exits 2 naming the item and the form to write)."""
    if value is None:
        return None
    try:
        etcd_members.parse(value)
    except RegistryError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


class RangeType(click.ParamType):
    name = "LO-HI"

    def convert(self, value, param, ctx):
        if isinstance(value, Range):
            return value
        try:
            return Range.parse(value)
        except VidError as exc:
            self.fail(str(exc), param, ctx)


class KeyType(click.ParamType):
    name = "KEY"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return codec.parse_key(value)
        except VidError as exc:
            self.fail(str(exc), param, ctx)


class NameType(click.ParamType):
    name = "NAME"

    def __init__(self, kind: str):
        self.kind = kind

    def convert(self, value, param, ctx):
        from vfab.vid.registry.schema import check_name

        try:
            return check_name(self.kind, value)
        except VidError as exc:
            self.fail(str(exc), param, ctx)


RANGE = RangeType()
KEY = KeyType()


def errors(fn):
    """Map vfab errors to click errors: bad input → exit 2, failures → exit 1, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (NotFound, Conflict, RegistryError) as exc:
            raise click.ClickException(str(exc)) from None
        except VidError as exc:
            raise click.UsageError(str(exc)) from None
        except VfabError as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper


def table(title: str, columns: list[str], rows: list[list]) -> Table:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[str(x) for x in r])
    return t
