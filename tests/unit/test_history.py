"""The history checker must catch what it exists to catch: fed known-bad histories, it fails them."""

from __future__ import annotations

from vfab.testbed import history


def row(client, op, key, value, invoke, respond, status="OK", version=1):
    return [client, op, key, value, invoke, respond, status, version]


def test_a_clean_history_passes():
    h = [row(1, "PUT", "k", "a", 0.0, 1.0), row(2, "GET", "k", "a", 2.0, 3.0), row(1, "PUT", "k", "b", 4.0, 5.0)]
    report = history.check(h, {"k": "b"}, 10.0)
    assert report["violations"] == [] and report["failed"] == [] and report["acked_puts"] == 2


def test_a_lost_acknowledged_write_is_caught():
    h = [row(1, "PUT", "k", "a", 0.0, 1.0), row(1, "PUT", "k", "b", 2.0, 3.0)]
    report = history.check(h, {"k": "a"}, 10.0)   # the final read-back lost b
    assert report["violations"] and "k" in report["violations"][0]


def test_a_stale_read_is_caught():
    h = [row(1, "PUT", "k", "a", 0.0, 1.0), row(1, "PUT", "k", "b", 2.0, 3.0), row(2, "GET", "k", "a", 4.0, 5.0)]
    report = history.check(h, {"k": "b"}, 10.0)
    assert any("returned 'a'" in v for v in report["violations"])


def test_a_value_nobody_wrote_is_caught():
    h = [row(1, "PUT", "k", "a", 0.0, 1.0), row(2, "GET", "k", "forged", 2.0, 3.0)]
    report = history.check(h, {"k": "a"}, 10.0)
    assert any("no put of this key wrote" in v for v in report["violations"])


def test_a_read_of_nothing_after_an_acknowledged_put_is_caught():
    h = [row(1, "PUT", "k", "a", 0.0, 1.0), row(2, "GET", "k", None, 2.0, 3.0, status="NOT_FOUND")]
    report = history.check(h, {"k": "a"}, 10.0)
    assert any("found nothing" in v for v in report["violations"])


def test_failed_requests_are_reported():
    h = [row(1, "PUT", "k", "a", 0.0, 1.0, status="TIMEOUT")]
    report = history.check(h, {"k": None}, 10.0)
    assert report["failed"] == [[1, "PUT", "k", "TIMEOUT"]] and report["violations"] == []


def test_deletes_are_writes_of_nothing():
    """A read of nothing after a delete is right; a value a later delete removed, read after that delete was
    acknowledged, is stale; a put after a delete makes a read of nothing stale again."""
    ok = [row(1, "PUT", "k", "a", 0.0, 1.0), row(1, "DEL", "k", None, 2.0, 3.0),
          row(2, "GET", "k", None, 4.0, 5.0, status="NOT_FOUND"), row(1, "DEL", "k", None, 6.0, 7.0,
                                                                       status="NOT_FOUND")]
    report = history.check(ok, {"k": None}, 10.0)
    assert report["violations"] == [] and report["acked_puts"] == 1 and report["acked_dels"] == 2
    stale = [row(1, "PUT", "k", "a", 0.0, 1.0), row(1, "DEL", "k", None, 2.0, 3.0), row(2, "GET", "k", "a", 4.0, 5.0)]
    assert any("returned 'a'" in v for v in history.check(stale, {"k": None}, 10.0)["violations"])
    resurrected = [row(1, "PUT", "k", "a", 0.0, 1.0), row(1, "DEL", "k", None, 2.0, 3.0)]
    assert any("returned 'a'" in v for v in history.check(resurrected, {"k": "a"}, 10.0)["violations"])
    lost_put = [row(1, "DEL", "k", None, 0.0, 1.0), row(1, "PUT", "k", "b", 2.0, 3.0),
                row(2, "GET", "k", None, 4.0, 5.0, status="NOT_FOUND")]
    got = history.check(lost_put, {"k": "b"}, 10.0)["violations"]
    assert any("found nothing" in v and "after the delete acknowledged at 1.0000" in v for v in got), got


def test_a_delete_that_overlaps_a_read_or_was_not_acknowledged_may_explain_nothing():
    """Concurrent with the read (it may have taken effect first), or never acknowledged (it may have taken
    effect at any time after it began): either explains a read of nothing; one begun after the read did not."""
    overlapping = [row(1, "PUT", "k", "a", 0.0, 1.0), row(1, "DEL", "k", None, 2.0, 6.0),
                   row(2, "GET", "k", None, 3.0, 4.0, status="NOT_FOUND")]
    assert history.check(overlapping, {"k": None}, 10.0)["violations"] == []
    timed_out = [row(1, "PUT", "k", "a", 0.0, 1.0), row(1, "DEL", "k", None, 2.0, 3.0, status="TIMEOUT"),
                 row(2, "GET", "k", None, 4.0, 5.0, status="NOT_FOUND")]
    report = history.check(timed_out, {"k": None}, 10.0)
    assert report["violations"] == [] and report["failed"] == [[1, "DEL", "k", "TIMEOUT"]]
    too_late = [row(1, "PUT", "k", "a", 0.0, 1.0), row(2, "GET", "k", None, 2.0, 3.0, status="NOT_FOUND"),
                row(1, "DEL", "k", None, 4.0, 5.0)]
    assert any("found nothing" in v for v in history.check(too_late, {"k": None}, 10.0)["violations"])
