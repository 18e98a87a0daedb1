"""History checker for KVS load runs: per-key linearizability of a register, and failed requests.

Input: history rows of ``vfab.services.elastic_kvs.loadgen`` (several processes
may be merged; times are CLOCK_MONOTONIC): ``[client, op, key, value, invoke,
respond, status, version]`` where a PUT's value is its unique tag, a GET's
value is the tag it read (None = not found) and a DEL's value is None.  A DEL
writes "absent"; every DEL of a key writes the same thing, so a read of
nothing may come from any of them (or from the key never having been
written).

For every key, each GET (the final read-back included) must return what some
write put there and nothing has overwritten since, as far as real time tells:

* a value: some PUT of that key wrote it, invoked before the GET returned,
  and no acknowledged write of the key (PUT or DEL) began after that PUT was
  acknowledged and ended before the GET began;
* nothing: the same holds for some DEL of the key invoked before the GET
  returned, or for the key's start (then no acknowledged write of the key
  may have ended before the GET began).

A write that was not acknowledged (timed out, refused) may have taken effect
at any time after it began: it can explain a read, and never makes one stale.
An acknowledged PUT whose value is lost fails at the final read-back; so does
an acknowledged DEL whose key came back.
"""

from __future__ import annotations

import math
from collections import defaultdict

OK_STATUSES = ("OK", "NOT_FOUND")
WRITES = ("PUT", "DEL")


def check(history: list[list], final: dict[str, str | None], final_at: float) -> dict:
    """Violations and counts. ``final``: key → tag read back after the load stopped (at ``final_at``)."""
    # key -> (invoke, respond or inf if not acknowledged, tag or None for a DEL)
    writes: dict[str, list[tuple[float, float, str | None]]] = defaultdict(list)
    reads: dict[str, list[tuple[float, float, str | None]]] = defaultdict(list)
    failed = []
    for client, op, key, value, invoke, respond, status, _version in history:
        if status not in OK_STATUSES:
            failed.append([client, op, key, status])
        if op in WRITES:
            writes[key].append((invoke, respond if status in OK_STATUSES else math.inf,
                                value if op == "PUT" else None))
        elif op == "GET" and status in OK_STATUSES:
            reads[key].append((invoke, respond, value if status == "OK" else None))
    for key, tag in final.items():
        reads[key].append((final_at, final_at, tag))
    violations = []
    for key, rs in reads.items():
        ws = writes.get(key, [])
        by_tag = {tag: (inv, resp) for inv, resp, tag in ws if tag is not None}
        dels = [(inv, resp) for inv, resp, tag in ws if tag is None]
        acked = [(inv, resp) for inv, resp, _ in ws if resp != math.inf]

        def overwritten(source_resp: float, r_inv: float) -> tuple[float, float] | None:
            """An acknowledged write that began after the source was acknowledged and ended before the read."""
            return next((w for w in acked if w[0] > source_resp and w[1] < r_inv), None)

        for r_inv, r_resp, tag in rs:
            if tag is None:
                # the key's start (acknowledged at -inf), or any DEL invoked before the read returned
                sources = [(-math.inf, -math.inf)] + [d for d in dels if d[0] <= r_resp]
                if all(overwritten(s[1], r_inv) for s in sources):
                    last = max(sources, key=lambda s: s[1])   # the latest source, overwritten too
                    w = overwritten(last[1], r_inv)
                    after = f"after the delete acknowledged at {last[1]:.4f} " if last[1] > -math.inf else ""
                    violations.append(f"{key}: read at {r_inv:.4f} found nothing, but a put was acknowledged "
                                      f"at {w[1]:.4f} {after}before the read began")
                continue
            if tag not in by_tag:
                violations.append(f"{key}: read returned {tag!r}, which no put of this key wrote")
                continue
            p_inv, p_resp = by_tag[tag]
            if p_inv > r_resp:
                violations.append(f"{key}: read returned {tag!r} before that put began")
                continue
            newer = overwritten(p_resp, r_inv)
            if newer:
                violations.append(f"{key}: read at {r_inv:.4f} returned {tag!r} (acked {p_resp:.4f}), but a later "
                                  f"write was acknowledged at {newer[1]:.4f} before the read began")
    acked_puts = sum(1 for ws in writes.values() for w in ws if w[1] != math.inf and w[2] is not None)
    acked_dels = sum(1 for ws in writes.values() for w in ws if w[1] != math.inf and w[2] is None)
    return {"ops": len(history), "acked_puts": acked_puts, "acked_dels": acked_dels, "keys": len(reads),
            "failed": failed, "violations": violations}
