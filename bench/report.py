"""``make report``: the latest benchmark results as one HTML page with tables and plots (matplotlib, headless).

Reads every ``bench/results/*.json`` a benchmark wrote (``bench/common.write``); of a benchmark's full and
smoke results the newer is shown.  Each benchmark gets a table of its numbers (every numeric leaf of its
results, by path); those with a plotter below also get PNG plots, written beside the page:

- kvs_throughput: requests/s and median latency by client count, elastic-KVS beside the standard KVS
- kvs_ops: each state operation's wall time, its phases stacked (flip: the clients' pause)
- reroute: a cut-over's time to the first frame at the new owner, median and p99, by client count
- metrics_cost: requests/s with and without metrics per round

Run: ``python bench/report.py [--results DIR] [--out DIR]`` (default bench/results, bench/results/report).
"""

from __future__ import annotations

import argparse
import glob
import html
import json
import os
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MAX_ROWS = 80   # numbers shown per benchmark (the JSON file has them all)


def _plt():
    import matplotlib
    matplotlib.use("Agg")   # headless: no display here or in CI
    import matplotlib.pyplot as plt
    return plt


def latest(results: str) -> dict[str, tuple[str, dict]]:
    """benchmark name -> (path, document): the newest file per benchmark (full or smoke)."""
    out: dict[str, tuple[str, dict]] = {}
    for path in sorted(glob.glob(os.path.join(results, "*.json"))):
        try:
            with open(path) as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or "benchmark" not in doc or "results" not in doc:
            continue   # a samples file or something else
        name = doc["benchmark"]
        if name not in out or doc.get("at", "") > out[name][1].get("at", ""):
            out[name] = (path, doc)
    return out


def numbers(x, path: str = "") -> list[tuple[str, float]]:
    """(path, value) of every number in ``x`` (booleans left out), depth first."""
    if isinstance(x, bool):
        return []
    if isinstance(x, (int, float)):
        return [(path, x)]
    if isinstance(x, dict):
        return [kv for k, v in x.items() for kv in numbers(v, f"{path}.{k}" if path else str(k))]
    if isinstance(x, list):
        return [kv for i, v in enumerate(x) for kv in numbers(v, f"{path}[{i}]")]
    return []


# -- plotters: (document, directory) -> [png paths] ----------------------------------------------------------
def plot_kvs_throughput(doc: dict, out: str) -> list[str]:
    plt = _plt()
    pts = sorted(doc["results"]["points"], key=lambda p: p["clients"])
    xs = [p["clients"] for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in ("elastic", "standard"):
        a.plot(xs, [p[kind]["req_per_s"] for p in pts], marker="o", label=kind)
        b.plot(xs, [p[kind]["median_ms"] for p in pts], marker="o", label=kind)
    a.set(xlabel="closed-loop clients", ylabel="requests/s", title="throughput")
    b.set(xlabel="closed-loop clients", ylabel="median latency (ms)", title="latency")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.grid(alpha=0.3)
    return [_save(plt, fig, out, "kvs_throughput")]


def plot_kvs_ops(doc: dict, out: str) -> list[str]:
    plt = _plt()
    rows = []
    for c in doc["results"]["configs"]:
        for o in c.get("ops", []):
            rows.append((f"{o['op']} {c['keys']} {c['placement']}", o.get("timings", {})))
    if not rows:
        return []
    phases = ["begin_s", "copy_s", "sync_s", "flip_s", "etcd_s", "after_s"]
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.35 * len(rows) + 1.5)))
    left = [0.0] * len(rows)
    for ph in phases:
        vals = [t.get(ph, 0.0) * 1e3 for _, t in rows]
        ax.barh(range(len(rows)), vals, left=left, label=ph[:-2])
        left = [x + v for x, v in zip(left, vals)]
    ax.set_yticks(range(len(rows)), [r for r, _ in rows])
    ax.invert_yaxis()
    ax.set(xlabel="ms", title="state operations: where the time went (flip = the clients' pause)")
    ax.legend(ncol=6, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.12))
    return [_save(plt, fig, out, "kvs_ops")]


def plot_reroute(doc: dict, out: str) -> list[str]:
    plt = _plt()
    by = doc["results"].get("by_clients", {})
    if not by:
        return []
    keys = sorted(by, key=lambda k: int(k) if str(k).isdigit() else 0)
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(keys))
    for off, stat in ((-0.2, "median_ms"), (0.2, "p99_ms")):
        ax.bar([x + off for x in xs], [by[k]["first"].get(stat, 0) for k in keys], width=0.4, label=stat[:-3])
    ax.set_xticks(list(xs), keys)
    ax.set(xlabel="clients", ylabel="ms", title="cut-over: etcd write to the first frame at the new owner")
    ax.legend()
    return [_save(plt, fig, out, "reroute")]


def plot_metrics_cost(doc: dict, out: str) -> list[str]:
    plt = _plt()
    res = doc["results"]
    rounds = res["rounds"]
    xs = list(range(len(rounds)))
    panels = [("req_per_s", "requests/s", f"throughput (median ratio {res.get('median_ratio')})")]
    if all(r["with"].get("server_cpu_us_per_req") for r in rounds):
        panels.append(("server_cpu_us_per_req", "server CPU-µs per request",
                       f"CPU per request (median ratio {res.get('median_cpu_ratio')})"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (key, ylabel, title) in zip(axes[0], panels):
        ax.bar([x - 0.2 for x in xs], [r["with"][key] for r in rounds], width=0.4, label="metrics on")
        ax.bar([x + 0.2 for x in xs], [r["without"][key] for r in rounds], width=0.4, label="metrics off")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set(xlabel="round", ylabel=ylabel, title=title)
        ax.legend(loc="lower right")
    fig.suptitle("elastic-KVS with metrics (scraped) and with --no-metrics, side by side")
    return [_save(plt, fig, out, "metrics_cost")]


PLOTTERS = {"kvs_throughput": plot_kvs_throughput, "kvs_ops": plot_kvs_ops, "reroute": plot_reroute,
            "metrics_cost": plot_metrics_cost}


def _save(plt, fig, out: str, name: str) -> str:
    path = os.path.join(out, f"{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def build(results: str, out: str) -> str:
    """Write ``out``/index.html (and the plots); its path."""
    os.makedirs(out, exist_ok=True)
    found = latest(results)
    parts = ["<!doctype html><meta charset=utf-8><title>vfab benchmarks</title>",
             "<style>body{font-family:sans-serif;max-width:70em;margin:auto}td,th{padding:2px 8px;"
             "text-align:left}tr:nth-child(even){background:#f3f3f3}code{font-size:90%}</style>",
             "<h1>vfab benchmark results</h1>",
             f"<p>{len(found)} benchmark(s) from <code>{html.escape(results)}</code>; how to run each: "
             "docs/benchmarks.md.</p><ul>"]
    parts += [f'<li><a href="#{html.escape(n)}">{html.escape(n)}</a></li>' for n in sorted(found)]
    parts.append("</ul>")
    for name in sorted(found):
        path, doc = found[name]
        parts.append(f'<h2 id="{html.escape(name)}">{html.escape(name)}</h2>')
        parts.append(f"<p><code>{html.escape(os.path.basename(path))}</code>, {html.escape(str(doc.get('at', '?')))}"
                     f", params <code>{html.escape(json.dumps(doc.get('params', {}), sort_keys=True))}</code></p>")
        plotter = PLOTTERS.get(name)
        if plotter is not None:
            try:
                for png in plotter(doc, out):
                    parts.append(f'<p><img src="{html.escape(os.path.basename(png))}" alt="{html.escape(name)}"></p>')
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                parts.append(f"<p>no plot: the results file has another shape ({html.escape(repr(exc))})</p>")
        rows = numbers(doc["results"])
        parts.append("<table><tr><th>result</th><th>value</th></tr>")
        parts += [f"<tr><td><code>{html.escape(p)}</code></td><td>{v:g}</td></tr>" for p, v in rows[:MAX_ROWS]]
        parts.append("</table>")
        if len(rows) > MAX_ROWS:
            parts.append(f"<p>… {len(rows) - MAX_ROWS} more numbers in the JSON file.</p>")
    page = os.path.join(out, "index.html")
    with open(page, "w") as fh:
        fh.write("\n".join(parts) + "\n")
    return page


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=RESULTS, help="folder of results files (default bench/results)")
    ap.add_argument("--out", default=None, help="folder of the page and plots (default RESULTS/report)")
    args = ap.parse_args(argv)
    out = args.out or os.path.join(args.results, "report")
    page = build(args.results, out)
    pngs = sorted(glob.glob(os.path.join(out, "*.png")))
    print(f"report: {page} ({len(latest(args.results))} benchmark(s), {len(pngs)} plot(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
