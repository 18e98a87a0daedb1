"""A client's requests served in the order it numbered them (services/memcached-helper/dpdk/mch_order.c, issue 43).

``mch_order_test`` (built by the core's Makefile, with and without sanitizers) drives the bookkeeping: a request
whose id is 1..8 ahead of the one its client is expected to send next is held until the ones between arrive or
its hold time passes; everything else goes at once.  The fabric test
(``test_mc_fabric.py::test_large_requests_follow_their_client_through_helpers_on_off_on``) shows why: the switch
hands a helper a client's 3 KB set (in fragments) ahead of the small get sent before it.
"""

from __future__ import annotations

from tests.unit.test_mc_proto import LineDriver


class Order(LineDriver):
    def run(self, line: str) -> list[str]:
        return self.cmd(line)

    def arrive(self, client: int, rid: int, now: int) -> tuple[str, int]:
        out = self.cmd(f"arrive {client} {rid} {now}")
        return out[0], int(out[1])

    def next(self, client: int) -> int | None:
        out = self.cmd(f"next {client}")
        return int(out[1]) if out[0] == "ITEM" else None

    def expired(self, now: int) -> tuple[int, int] | None:
        out = self.cmd(f"expired {now}")
        return (int(out[1]), int(out[2])) if out[0] == "ITEM" else None

    def ctr(self) -> dict[str, int]:
        out = self.cmd("ctr")
        return dict(zip(("held", "filled", "expired", "late", "full", "nheld"), map(int, out[1:])))


order = Order.fixture("mch_order_test")


def test_in_order_requests_go_at_once(order):
    order.run("init 1000")
    assert [order.arrive(7, r, 0)[0] for r in range(1, 20)] == ["GO"] * 19
    assert order.ctr()["held"] == 0


def test_a_request_ahead_waits_for_the_one_before_it(order):
    """get (rid 5) sent before set (rid 6); the set comes first: it waits, the get goes, then the set."""
    order.run("init 1000")
    assert order.arrive(3, 4, 0)[0] == "GO"
    verdict, set_item = order.arrive(3, 6, 10)
    assert verdict == "HOLD"
    assert order.next(3) is None                       # nothing is next yet
    assert order.arrive(3, 5, 20)[0] == "GO"           # the get
    assert order.next(3) == set_item                   # then the set
    assert order.next(3) is None
    assert order.arrive(3, 7, 30)[0] == "GO"
    assert order.ctr() == {"held": 1, "filled": 1, "expired": 0, "late": 0, "full": 0, "nheld": 0}


def test_several_held_come_out_in_their_order(order):
    order.run("init 1000")
    order.arrive(1, 10, 0)
    held = {r: order.arrive(1, r, 1)[1] for r in (14, 12, 13)}
    assert order.arrive(1, 11, 2)[0] == "GO"
    assert [order.next(1) for _ in range(4)] == [held[12], held[13], held[14], None]


def test_a_lost_request_releases_the_later_ones_after_the_hold(order):
    order.run("init 1000")
    order.arrive(2, 1, 0)
    _, a = order.arrive(2, 4, 100)
    _, b = order.arrive(2, 3, 150)       # 2 never comes
    assert order.expired(1099) is None
    assert order.cmd("due 1000") == ["DUE", "100"]
    assert order.expired(1100) == (b, 2)  # the earliest-numbered of that client first
    assert order.next(2) == a
    assert order.ctr()["expired"] == 1 and order.ctr()["nheld"] == 0
    assert order.arrive(2, 2, 1200)[0] == "GO"   # the lost one turning up late goes at once, counted
    assert order.ctr()["late"] == 1
    assert order.cmd("due 1200") == ["NEVER"]


def test_clients_are_apart_and_jumps_and_wraps_go_at_once(order):
    order.run("init 1000")
    order.arrive(1, 100, 0)
    order.arrive(2, 100, 0)
    assert order.arrive(1, 102, 1)[0] == "HOLD"
    assert order.arrive(2, 101, 1)[0] == "GO"          # another client is not held back
    assert order.arrive(2, 500, 2)[0] == "GO"          # a jump: the client counts from there
    assert order.arrive(2, 501, 3)[0] == "GO"
    order.arrive(3, 65535, 0)
    assert order.arrive(3, 1, 1)[0] == "GO"            # wrap that skips 0 (ours)
    order.arrive(4, 65535, 0)
    assert order.arrive(4, 0, 1)[0] == "GO"            # wrap through 0 (others)
    order.arrive(5, 0x0BFF, 0)                         # libmemcached: bits of its own, a 10-bit count that wraps
    assert order.arrive(5, 0x0800, 1)[0] == "GO"       # 1,023 back: a new count, not a straggler
    assert order.arrive(5, 0x0802, 2)[0] == "HOLD"     # ... so order holds again from there
    assert order.ctr()["late"] == 0


def test_no_hold_time_never_holds_and_the_table_has_a_bound(order):
    order.run("init 0")
    order.arrive(1, 1, 0)
    assert order.arrive(1, 3, 1)[0] == "GO"
    order.run("init 1000")
    for c in range(40):
        order.arrive(c, 1, 0)
    verdicts = [order.arrive(c, 3, 1)[0] for c in range(40)]
    assert verdicts == ["HOLD"] * 32 + ["GO"] * 8       # MCH_ORDER_HELD, then served at once, counted
    assert order.ctr()["full"] == 8
