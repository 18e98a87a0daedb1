"""Shared fixtures: a private etcd for the session, a clean registry per test."""

from __future__ import annotations

import ast
import importlib.abc
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _map_packages() -> None:
    """Make ``vfab.*`` importable from the source tree even after a legacy ``setup.py develop``.

    ``pip install -e`` without PEP 660 only puts the repo on sys.path, which finds
    ``vfab`` but not the ``package_dir`` mapping (vfab.vid -> vid-lib/ ...).
    """
    try:
        import vfab.vid  # noqa: F401
        return
    except ModuleNotFoundError:
        pass
    tree = ast.parse((ROOT / "setup.py").read_text())
    mapping = next(
        ast.literal_eval(node.value) for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PACKAGE_DIR"
    )

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            folder = mapping.get(fullname)
            if folder is None or not (ROOT / folder / "__init__.py").exists():
                return None
            return importlib.util.spec_from_file_location(
                fullname, ROOT / folder / "__init__.py",
                submodule_search_locations=[str(ROOT / folder)])

    sys.meta_path.insert(0, Finder())
    for name in [m for m in sys.modules if m == "vfab" or m.startswith("vfab.")]:
        del sys.modules[name]


_map_packages()

from vfab.testbed.etcd import LocalEtcd, free_port  # noqa: E402
from vfab.vid.store import Registry  # noqa: E402


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory):
    """A private etcd member on 127.0.0.1 with random ports; yields "127.0.0.1:PORT"."""
    last = None
    for _ in range(3):  # free ports can be taken between probing and binding
        etcd = LocalEtcd(tmp_path_factory.mktemp("etcd"), free_port(), free_port())
        try:
            etcd.start(timeout=20)
        except Exception as exc:  # noqa: BLE001 - retried, then re-raised
            last = exc
            continue
        try:
            yield etcd.endpoint
        finally:
            etcd.stop()
        return
    raise last


@pytest.fixture
def registry(etcd_endpoint):
    """A Registry on an empty /vfab/ tree; its lease keepalives stop afterwards."""
    reg = Registry(etcd_endpoint)
    reg.delete_prefix("/vfab/")
    yield reg
    reg.close()
    reg.delete_prefix("/vfab/")
