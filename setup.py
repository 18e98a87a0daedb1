"""vfab: a layer-2 virtual-endpoint elastic services fabric.

The one installer (DESIGN.md §1). Each top-level folder is a subpackage of
``vfab``; ``package_dir`` maps the import names onto the fixed layout.
"""

from setuptools import setup

PACKAGE_DIR = {
    "vfab": "vfab",
    "vfab.vid": "vid-lib",
    "vfab.vid.registry": "vid-lib/registry",
    "vfab.vid.state": "vid-lib/state",
    "vfab.fabric": "fabric",
    "vfab.controller": "controller",
    "vfab.services": "services",
    "vfab.services.echo": "services/echo",
    "vfab.services.elastic_kvs": "services/elastic-kvs",
    "vfab.services.sdhcp": "services/sdhcp",
    "vfab.services.memcached_helper": "services/memcached-helper",
    "vfab.testbed": "testbed",
    "vfab.cli": "cli",
}

setup(
    name="vfab",
    version="0.1.0",
    description="Layer-2 virtual-endpoint elastic services fabric (VIDs on Open vSwitch)",
    python_requires=">=3.11",
    packages=list(PACKAGE_DIR),
    package_dir=PACKAGE_DIR,
    install_requires=[
        "os-ken>=4.0",
        "pyzmq>=25",
        "click>=8.1",
        "rich>=13",
        "prometheus_client>=0.17",   # every process's /metrics (vfab.vid.metrics)
    ],
    extras_require={"test": ["pytest>=8", "hypothesis>=6", "ruff>=0.5", "redis>=5", "pyyaml>=6"]},
    entry_points={"console_scripts": ["vfab=vfab.cli.main:main"]},
)
