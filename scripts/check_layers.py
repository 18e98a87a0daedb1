#!/usr/bin/env python3
"""The layering rules of the tree (issue 47), checked from the sources alone (nothing is imported).

1. A service never imports the harness or the CLI: nothing under ``services/`` imports ``vfab.testbed`` or
   ``vfab.cli``.
2. The library stays at the bottom: nothing under ``vid-lib/`` imports ``vfab.fabric``, ``vfab.controller``,
   ``vfab.services``, ``vfab.testbed`` or ``vfab.cli``.
3. No import cycle between files.  Imports inside functions and under ``TYPE_CHECKING`` count too: they
   are still a dependency (a later one, or the type's), and the cure is the same (a narrower interface,
   e.g. a ``typing.Protocol`` the collaborator declares).

Known violations that are still to be removed are listed in ``BASELINE`` below, each with the rule it
breaks; a violation not in it fails, and so does a baseline entry that no longer occurs (remove it: the
list only shrinks).  Exit 0 when clean, 1 with one line per finding.

    python3 scripts/check_layers.py            # from the repository root
"""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {                      # folder -> import name (setup.py's PACKAGE_DIR)
    "vfab": "vfab", "vid-lib": "vfab.vid", "vid-lib/registry": "vfab.vid.registry", "vid-lib/state": "vfab.vid.state",
    "fabric": "vfab.fabric", "controller": "vfab.controller",
    "services": "vfab.services", "services/echo": "vfab.services.echo",
    "services/elastic-kvs": "vfab.services.elastic_kvs", "services/sdhcp": "vfab.services.sdhcp",
    "services/memcached-helper": "vfab.services.memcached_helper", "testbed": "vfab.testbed", "cli": "vfab.cli",
}
UPWARD = ("vfab.fabric", "vfab.controller", "vfab.services", "vfab.testbed", "vfab.cli")

# Known, to be removed (issue 47): "rule: module -> module" for rules 1-2, "cycle: a, b, ..." for rule 3.
BASELINE: set[str] = {
    'service imports harness or CLI: vfab.services.memcached_helper.demo -> vfab.cli.main',
    'service imports harness or CLI: vfab.services.memcached_helper.demo -> vfab.testbed.fabric',
    'service imports harness or CLI: vfab.services.memcached_helper.onfabric -> vfab.testbed.procs',
    'service imports harness or CLI: vfab.services.memcached_helper.topo -> vfab.testbed.procs',
    'service imports harness or CLI: vfab.services.sdhcp.cli -> vfab.cli.cmd_state',
    'service imports harness or CLI: vfab.services.sdhcp.cli -> vfab.cli.common',
    'service imports harness or CLI: vfab.services.sdhcp.demo -> vfab.cli.cmd_state',
    'service imports harness or CLI: vfab.services.sdhcp.demo -> vfab.cli.main',
    'service imports harness or CLI: vfab.services.sdhcp.demo -> vfab.testbed.dhcpclients',
    'service imports harness or CLI: vfab.services.sdhcp.demo -> vfab.testbed.fabric',
    'service imports harness or CLI: vfab.services.sdhcp.demo -> vfab.testbed.procs',
}


def modules(root: str = ROOT) -> dict[str, str]:
    """Every module's import name -> its file."""
    found: dict[str, str] = {}
    for folder, pkg in PACKAGES.items():
        base = os.path.join(root, folder)
        for dirpath, dirnames, files in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            rel = os.path.relpath(dirpath, base)
            if rel != "." and os.path.join(folder, rel).replace(os.sep, "/") in PACKAGES:
                continue                              # a sub-package with its own entry
            if rel != ".":
                continue                              # not a package of setup.py (native/, dpdk/, ...)
            for f in files:
                if f.endswith(".py"):
                    name = pkg if f == "__init__.py" else f"{pkg}.{f[:-3]}"
                    found[name] = os.path.join(dirpath, f)
    return found


def imports(name: str, path: str, known: dict[str, str]) -> set[str]:
    """The vfab modules ``name`` imports (a package's ``__init__`` counts only when nothing deeper matches)."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    out: set[str] = set()

    def resolve(mod: str) -> None:
        while mod and mod not in known:
            mod = mod.rpartition(".")[0]
        if mod and mod != name:
            out.add(mod)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("vfab"):
                    resolve(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                base = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("vfab"):
                continue
            for a in node.names:
                full = f"{mod}.{a.name}"
                resolve(full if full in known else mod)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def findings(root: str = ROOT) -> set[str]:
    known = modules(root)
    graph = {m: imports(m, p, known) for m, p in known.items()}
    found: set[str] = set()
    for m, deps in graph.items():
        for d in deps:
            if m.startswith("vfab.services") and d.startswith(("vfab.testbed", "vfab.cli")):
                found.add(f"service imports harness or CLI: {m} -> {d}")
            if m.startswith("vfab.vid") and d.startswith(UPWARD):
                found.add(f"library imports upward: {m} -> {d}")
    for comp in cycles(graph):
        found.add(f"cycle: {', '.join(comp)}")
    return found


def main() -> int:
    found = findings()
    new = sorted(found - BASELINE)
    gone = sorted(BASELINE - found)
    for f in new:
        print(f"check_layers: {f}")
    for f in gone:
        print(f"check_layers: fixed, remove it from BASELINE in {os.path.relpath(__file__, ROOT)}: {f}")
    if not new and not gone:
        print(f"check_layers: {len(found)} known violations (BASELINE), nothing new")
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main())
