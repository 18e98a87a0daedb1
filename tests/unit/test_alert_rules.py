"""The shipped alert rules (docs/prometheus/vfab-rules.yml) pass ``promtool check rules`` and their unit tests
(tests/unit/prometheus/vfab-rules.test.yml, ``promtool test rules``); every alert has a firing case and a quiet
case there; and the tests catch a broken rule (a threshold moved)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "prometheus" / "vfab-rules.yml"
TESTS = ROOT / "tests" / "unit" / "prometheus" / "vfab-rules.test.yml"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: it comes with Debian's 'prometheus' package, which scripts/bootstrap.sh "
                    "installs; run 'make bootstrap' (as root)")
    return path


def _run(*cmd: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd)


def test_rules_are_valid(promtool):
    res = _run(promtool, "check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr


def test_rule_unit_tests_pass(promtool):
    res = _run(promtool, "test", "rules", TESTS.name, cwd=TESTS.parent)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_alert_fires_and_stays_quiet_in_a_test():
    alerts = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 8
    cases = [c for t in yaml.safe_load(TESTS.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    for name in alerts:
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c.get("exp_alerts") for c in mine), f"{name}: no test where it fires"
        assert any(not c.get("exp_alerts") for c in mine), f"{name}: no test where it stays quiet"
    for needed in ("VfabRangeNoLiveOwner", "VfabOwnerDownNoMirror", "VfabOperationStuck", "VfabCutoverSlow",
                   "VfabHelperDown", "VfabSdhcpPoolNearlyExhausted", "VfabSwitchBehind"):
        assert needed in alerts


@pytest.mark.parametrize("old,new", [("vfab_state_op_phase_age_seconds) > 60", "vfab_state_op_phase_age_seconds) > 600"),
                                     ('state="lost"}) > 0', 'state="lost"}) > 1'),
                                     ("/ sum by (service) (vfab_sdhcp_pool_addresses) > 0.9",
                                      "/ sum by (service) (vfab_sdhcp_pool_addresses) > 0.99")])
def test_unit_tests_catch_a_broken_rule(promtool, tmp_path, old, new):
    text = RULES.read_text()
    assert old in text
    (tmp_path / "rules.yml").write_text(text.replace(old, new))
    tests = TESTS.read_text().replace("../../../docs/prometheus/vfab-rules.yml", "rules.yml")
    (tmp_path / "t.yml").write_text(tests)
    res = _run(promtool, "test", "rules", "t.yml", cwd=tmp_path)
    assert res.returncode != 0, "the rule tests passed with a broken rule"
