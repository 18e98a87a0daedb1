"""The re-admission rule of a withdrawn helper (services/memcached-helper/readmit.py, issue 43)."""

from __future__ import annotations

from vfab.services.memcached_helper.readmit import Readmit


def first_return(r: Readmit, start: float, step: float = 0.05, limit: float = 60.0) -> float:
    """Seconds from ``start`` (serving throughout) until the rule lets the helper back."""
    t = start
    while not r.may_return(t, True):
        t += step
        assert t - start < limit
    return t - start


def test_one_stall_comes_back_after_the_base_hold():
    r = Readmit(base=0.5, cap=8.0, window=30.0)
    r.withdrawn(100.0)
    assert not r.may_return(100.1, False)
    assert abs(first_return(r, 100.2) - 0.5) < 0.051


def test_the_hold_doubles_with_each_withdrawal_in_the_window_up_to_the_cap():
    r = Readmit(base=0.5, cap=4.0, window=30.0)
    holds = []
    t = 0.0
    for _ in range(6):
        r.withdrawn(t)
        holds.append(r.hold(t))
        t += first_return(r, t + 0.1) + 0.2
    assert holds == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_serving_must_be_uninterrupted():
    r = Readmit(base=1.0)
    r.withdrawn(0.0)
    assert not r.may_return(0.1, True)
    assert not r.may_return(0.9, False)     # a relapse restarts the count
    assert not r.may_return(1.2, True)
    assert not r.may_return(2.1, True)
    assert r.may_return(2.2, True)


def test_old_withdrawals_stop_counting():
    r = Readmit(base=0.5, cap=8.0, window=30.0)
    for t in (0.0, 5.0, 10.0):
        r.withdrawn(t)
    assert r.hold(10.0) == 2.0
    r.withdrawn(50.0)                        # the three are past the window
    assert r.hold(50.0) == 0.5
    assert "1 withdrawal(s) in the last 30 s" in r.explain(50.0)
