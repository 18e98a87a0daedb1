"""The helper's checksum sums (services/memcached-helper/dpdk/mch_csum.h) against RFC 1071 computed here.

``mch_csum_test`` (built by the core's Makefile, with and without sanitizers, through test_mc_proto.core_build)
answers each ``sum <offset> <hex>`` with the folded 16-bit sum from ``mch_csum`` and from ``mch_csum_copy``
(the reply path's copy that sums as it goes) and whether that copy holds the bytes and nothing else.  The
helper puts these sums into every request check and every reply frame; a wrong one would have the clients'
kernels drop its replies (the fabric tests would see that too, as lost gets).
"""

from __future__ import annotations

import random


from tests.unit.test_mc_proto import LineDriver


def rfc1071(data: bytes) -> int:
    """The one's-complement sum of big-endian 16-bit words (a last odd byte padded with zero), folded."""
    if len(data) % 2:
        data += b"\0"
    s = sum(int.from_bytes(data[i:i + 2], "big") for i in range(0, len(data), 2))
    while s > 0xFFFF:
        s = (s & 0xFFFF) + (s >> 16)
    return s


class Csum(LineDriver):
    def sums(self, data: bytes, offset: int = 0) -> tuple[int, int, str]:
        out = self.cmd(f"sum {offset} {data.hex()}")
        assert out[0] == "SUM" and out[2] == "COPY", out
        return int(out[1], 16), int(out[3], 16), out[4]


csum = Csum.fixture("mch_csum_test")


def test_rfc1071_example_and_edges(csum):
    assert csum.sums(bytes.fromhex("0001f203f4f5f6f7")) == (0xDDF2, 0xDDF2, "ok")   # RFC 1071's worked example
    assert csum.sums(bytes.fromhex("0001f203f4f5f6f7ab")) == (0x88F3, 0x88F3, "ok")  # odd byte: a word ab00
    assert csum.sums(b"") == (0, 0, "ok")
    assert csum.sums(b"\xff" * 4000) == (0xFFFF, 0xFFFF, "ok")                    # a sum of 0xffff words
    assert rfc1071(b"\xff" * 1001) == 0xFF00
    assert csum.sums(b"\xff" * 1001) == (0xFF00, 0xFF00, "ok")


def test_random_lengths_and_alignments_match_rfc1071(csum):
    rng = random.Random(1071)
    lengths = list(range(0, 40)) + [rng.randrange(40, 4096) for _ in range(300)] + [4095, 4096]
    for n in lengths:
        data = bytes(rng.randrange(256) for _ in range(n))
        off = rng.randrange(8)
        want = rfc1071(data)
        assert csum.sums(data, off) == (want, want, "ok"), (n, off, data.hex())


def test_carries_across_every_fold(csum):
    """Large words everywhere: the 64-bit accumulator's halves, and the folds from 64 to 16 bits, all carry."""
    rng = random.Random(16)
    for n in (8, 9, 64, 1392, 1400, 4096):
        data = bytes(rng.choice((0xFE, 0xFF)) for _ in range(n))
        want = rfc1071(data)
        assert csum.sums(data, n % 8) == (want, want, "ok"), n
