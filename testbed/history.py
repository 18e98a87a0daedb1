"""History checker for KVS load runs: per-key linearizability of a register, and failed requests.

Input: history rows of ``vfab.services.elastic_kvs.loadgen`` (several processes
may be merged; times are CLOCK_MONOTONIC): ``[client, op, key, value, invoke,
respond, status, version]`` where a PUT's value is its unique tag and a GET's
value is the tag it read (None = not found).  Writes are PUTs only (the
checked workloads do not delete).

For every key, each GET (the final read-back included) must return a value
that (1) some PUT of that key wrote, invoked before the GET returned, and
(2) was not superseded: no acknowledged PUT of the key began after the read
value's PUT was acknowledged and ended before the GET began.  A GET that finds
nothing is wrong if an acknowledged PUT of the key ended before it began.  An
acknowledged PUT whose value is lost fails (2) at the final read-back.
"""

from __future__ import annotations

import math
from collections import defaultdict

OK_STATUSES = ("OK", "NOT_FOUND")


def check(history: list[list], final: dict[str, str | None], final_at: float) -> dict:
    """Violations and counts. ``final``: key → tag read back after the load stopped (at ``final_at``)."""
    puts: dict[str, list[tuple[float, float, str]]] = defaultdict(list)  # key -> (invoke, respond|inf, tag)
    reads: dict[str, list[tuple[float, float, str | None]]] = defaultdict(list)
    failed = []
    for client, op, key, value, invoke, respond, status, _version in history:
        if status not in OK_STATUSES:
            failed.append([client, op, key, status])
        if op == "PUT":
            puts[key].append((invoke, respond if status == "OK" else math.inf, value))
        elif op == "GET" and status in OK_STATUSES:
            reads[key].append((invoke, respond, value if status == "OK" else None))
    for key, tag in final.items():
        reads[key].append((final_at, final_at, tag))
    violations = []
    for key, rs in reads.items():
        ps = puts.get(key, [])
        by_tag = {tag: (inv, resp) for inv, resp, tag in ps}
        acked = [(inv, resp) for inv, resp, _ in ps if resp != math.inf]
        for r_inv, r_resp, tag in rs:
            if tag is None:
                early = [p for p in acked if p[1] < r_inv]
                if early:
                    violations.append(f"{key}: read at {r_inv:.4f} found nothing, but a put was acknowledged "
                                      f"at {early[0][1]:.4f}")
                continue
            if tag not in by_tag:
                violations.append(f"{key}: read returned {tag!r}, which no put of this key wrote")
                continue
            p_inv, p_resp = by_tag[tag]
            if p_inv > r_resp:
                violations.append(f"{key}: read returned {tag!r} before that put began")
                continue
            newer = [q for q in acked if q[0] > p_resp and q[1] < r_inv]
            if newer:
                violations.append(f"{key}: read at {r_inv:.4f} returned {tag!r} (acked {p_resp:.4f}), but a later "
                                  f"put was acknowledged at {newer[0][1]:.4f} before the read began")
    acked_puts = sum(1 for ps in puts.values() for p in ps if p[1] != math.inf)
    return {"ops": len(history), "acked_puts": acked_puts, "keys": len(reads), "failed": failed,
            "violations": violations}
