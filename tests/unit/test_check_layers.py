"""scripts/check_layers.py: the layering rules find what breaks them (make test runs it on the tree)."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("check_layers", os.path.join(ROOT, "scripts", "check_layers.py"))
layers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layers)


def write(root, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_each_rule_is_found_in_a_small_tree(tmp_path):
    for pkg in ("vfab", "vid-lib", "vid-lib/state", "services", "services/echo", "testbed", "cli", "fabric"):
        write(tmp_path, f"{pkg}/__init__.py")
    write(tmp_path, "services/echo/server.py", "def main():\n    from vfab.testbed.procs import wait_for\n")
    write(tmp_path, "testbed/procs.py")
    write(tmp_path, "vid-lib/codec.py", "from vfab.fabric import flows\n")
    write(tmp_path, "fabric/flows.py")
    write(tmp_path, "vid-lib/state/loop.py", "from vfab.vid.state import runner\n")
    write(tmp_path, "vid-lib/state/runner.py",
          "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .loop import EndpointLoop\n")
    assert layers.findings(str(tmp_path)) == {
        "service imports harness or CLI: vfab.services.echo.server -> vfab.testbed.procs",
        "library imports upward: vfab.vid.codec -> vfab.fabric.flows",
        "cycle: vfab.vid.state.loop, vfab.vid.state.runner",
    }


def test_cycles_are_the_strongly_connected_parts():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "f": {"f"}}
    assert layers.cycles(graph) == [["a", "b", "c"]]


def test_the_tree_has_nothing_new_and_the_baseline_only_what_still_occurs():
    found = layers.findings()
    assert found - layers.BASELINE == set(), "new layering violations"
    assert layers.BASELINE - found == set(), "fixed: remove these from BASELINE"
