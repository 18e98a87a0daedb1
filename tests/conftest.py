"""Shared fixtures: a private etcd for the session, a clean registry per test."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from vfab.testbed.etcd import LocalEtcd, free_port
from vfab.vid.registry import Registry

# Property tests check behaviour, not speed: on these shared 2-core machines an example can take seconds
# when other work holds the cores, which Hypothesis would otherwise report as a failure (deadline 200 ms,
# "too slow" data generation).  Speed is measured by bench/.
settings.register_profile("vfab", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("vfab")


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
