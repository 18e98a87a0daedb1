"""services/elastic-kvs/session.py: a key's completion records, their floors and their expiry."""

from __future__ import annotations

import pytest

from vfab.services.elastic_kvs import session
from vfab.services.elastic_kvs.session import DONE, NEW, STALE, Entry

A, B = 0xA, 0xB
NOW = 1_800_000_000.0


def test_layout_and_round_trip():
    table = {A: Entry(3, 1234, {3: 7, 5: session.result_of(9, True)}), B: Entry(0, 99, {})}
    blob = session.serialize(table)
    assert len(blob) == 2 * session.ENTRY.size + 2 * session.RECORD.size == 2 * 22 + 32
    assert blob[:22] == A.to_bytes(8, "big") + (3).to_bytes(8, "big") + (1234).to_bytes(4, "big") + b"\x00\x02"
    assert session.parse(blob) == table
    assert session.parse(b"") == {}
    assert session.split_result(table[A].records[5]) == (9, True)


@pytest.mark.parametrize("cut", [1, 10, 23])
def test_a_truncated_table_is_refused(cut):
    blob = session.serialize({A: Entry(0, 1, {1: 1})})
    with pytest.raises(ValueError, match="truncated completion table"):
        session.parse(blob[:-cut])


def test_lookup_new_done_stale():
    blob = session.add(b"", A, 4, 2, int(NOW) + 20, 11, NOW)
    assert session.lookup(blob, A, 4) == (DONE, 11)
    assert session.lookup(blob, A, 5) == (NEW, 0)          # a later request
    assert session.lookup(blob, A, 3) == (NEW, 0)          # not acknowledged yet (acked 2): may be in flight
    assert session.lookup(blob, A, 1) == (STALE, 2)        # the client has its answer
    assert session.lookup(blob, B, 4) == (NEW, 0)          # another client's ids are its own


def test_the_floor_drops_the_records_the_client_has_answers_for():
    blob = b""
    for seq in range(1, 6):
        blob = session.add(blob, A, seq, 1, int(NOW) + 20, seq, NOW)   # five in flight, none acknowledged
    assert sorted(session.parse(blob)[A].records) == [1, 2, 3, 4, 5]
    blob = session.add(blob, A, 6, 4, int(NOW) + 20, 6, NOW)           # 1-3 answered
    e = session.parse(blob)[A]
    assert (e.floor, sorted(e.records)) == (4, [4, 5, 6])
    assert session.lookup(blob, A, 2) == (STALE, 4) and session.lookup(blob, A, 5) == (DONE, 5)
    # a floor never goes back (a late request carries an older acked)
    blob = session.add(blob, A, 7, 1, int(NOW) + 20, 7, NOW)
    assert session.parse(blob)[A].floor == 4


def test_entries_expire_skew_seconds_after_their_last_deadline_and_not_before():
    blob = session.add(b"", A, 1, 0, int(NOW) + 10, 1, NOW)
    later = NOW + 10 + session.SKEW
    blob2 = session.add(blob, B, 1, 0, int(later) + 10, 2, later)      # exactly at the edge: kept
    assert set(session.parse(blob2)) == {A, B}
    blob3 = session.add(blob2, B, 2, 0, int(later) + 10, 3, later + 1)  # past it: A's entry goes
    assert set(session.parse(blob3)) == {B}
    # a client's own entry stays while it writes, its until follows its newest deadline
    blob4 = session.add(blob, A, 2, 0, int(later) + 10, 2, later + 1)
    assert session.parse(blob4)[A].until == int(later) + 10 and session.lookup(blob4, A, 1) == (DONE, 1)


def test_a_full_table_refuses_instead_of_forgetting():
    blob = b""
    for seq in range(1, session.MAX_RECORDS + 1):
        blob = session.add(blob, A, seq, 1, int(NOW) + 20, seq, NOW)
    with pytest.raises(session.SessionFull, match=r"1024 unacknowledged writes of this key \(the limit is 1024\)"):
        session.add(blob, A, session.MAX_RECORDS + 1, 1, int(NOW) + 20, 0, NOW)
    # once the client acknowledges, it fits again
    blob = session.add(blob, A, session.MAX_RECORDS + 1, session.MAX_RECORDS, int(NOW) + 20, 0, NOW)
    assert sorted(session.parse(blob)[A].records) == [session.MAX_RECORDS, session.MAX_RECORDS + 1]
    many = b""
    with pytest.raises(session.SessionFull, match=r"the limit is 65535 B"):
        for c in range(1, 4000):
            many = session.add(many, c, 1, 0, int(NOW) + 20, 1, NOW)
