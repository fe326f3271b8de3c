"""The benchmarks' plots, each drawn from the JSON its benchmark wrote.

Run in the plotting venv (matplotlib, which the project does not depend on) by
:func:`benchmarks.common.plot_in_venv`, from the repository root::

    python -m benchmarks.plots KIND JSON PNG

``KIND`` is one of :data:`PLOTS`. Only the standard library is imported at the top, and numpy
and matplotlib inside: that venv has nothing else.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENCODING_LABEL = {"json": "HTTP JSON", "binary": "HTTP binary", "grpc": "gRPC"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_concurrency(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[Any, list[dict[str, Any]]]:
    """``rows`` grouped by ``key``, each group in order of concurrency."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return {k: sorted(v, key=lambda r: r["concurrency"]) for k, v in groups.items()}


def batching(data: dict[str, Any], png: Path) -> None:
    """Images/s against concurrency, per server configuration, and the in-process ceiling."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in _by_concurrency(data["results"], lambda r: r["variant"]).items():
        ax.plot([r["concurrency"] for r in rows], [r["req_per_s"] for r in rows], marker="o", label=label)
    ceiling = data["ceiling"]["best_images_per_s"]
    ax.axhline(ceiling, linestyle="--", color="grey", label="ceiling: onnxruntime in-process, best batch")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (HTTP connections, one image per request)")
    ax.set_ylabel("images/s")
    ax.set_ylim(bottom=0)
    ax.set_title("ResNet-50 (ONNX, CPU) through quiver serve")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def http_throughput(data: dict[str, Any], png: Path) -> None:
    """Requests/s against concurrency per target and encoding; the onnxruntime floor as a line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    served = [r for r in data["results"] if r["target"] != "floor-ort"]
    for (label, encoding), rows in _by_concurrency(served, lambda r: (r["label"], r["encoding"])).items():
        ax.plot([r["concurrency"] for r in rows], [r["req_per_s"] for r in rows], marker="o", label=f"{label}, {encoding}")
    for r in data["results"]:
        if r["target"] == "floor-ort":
            ax.axhline(r["req_per_s"], linestyle="--", color="grey", label=r["label"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("requests/s")
    ax.set_title("simple model over HTTP and gRPC")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def multi_model(data: dict[str, Any], png: Path) -> None:
    """Hit rate over the trace (Quiver, LRU simulated, Belady; a sliding window) and the
    latency of each request by kind."""
    import numpy as np

    plt = _pyplot()
    per = data["per_request"]
    window = max(10, min(250, len(per["kinds"]) // 10))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True)
    for label, seq, style in (
        (f"Quiver ({data.get('eviction_policy', 'lru')})", [k == "H" for k in per["kinds"]], "-"),
        ("LRU simulated", [k == "H" for k in per["lru_simulated"]], "--"),
        ("Belady MIN (offline optimum)", [k == "H" for k in per["belady"]], ":"),
    ):
        hits = np.array(seq, dtype=float)
        rolling = np.convolve(hits, np.ones(window) / window, mode="valid")
        top.plot(np.arange(window, len(hits) + 1), rolling, style, label=f"{label}: {hits.mean():.3f} overall")
    top.set_ylabel(f"hit rate, last {window} requests")
    top.set_ylim(0, 1)
    top.legend(loc="lower right", fontsize=8)
    top.grid(alpha=0.3)
    s3 = data.get("source") == "s3"
    where = "S3 (SeaweedFS), .tar.gz archives" if s3 else "local folders"
    top.set_title(
        f"Zipf({data['zipf']}) over {data['models']} models from {where}, "
        f"memory for {data['resident']} (room {data['most_models_loaded_at_once']})",
        fontsize=10,
    )
    latency = np.array(per["latency_ms"])
    index = np.arange(len(latency))
    for kind, label, color in (
        ("H", "hit", "tab:green"),
        ("M", "miss, model from the disk cache" if s3 else "miss", "tab:orange"),
        ("C", "miss, downloaded from S3 (cold)", "tab:red"),
    ):
        mask = np.array([k == kind for k in per["kinds"]])
        if mask.any():
            p50 = float(np.median(latency[mask]))
            bottom.scatter(index[mask], latency[mask], s=3, color=color, alpha=0.5,
                           label=f"{label}: {mask.sum()}, p50 {p50:.1f} ms")  # fmt: skip
    floor = data["cold_floor_ms"]["total_ms"]
    bottom.axhline(floor, color="black", lw=0.8, ls="--", label=f"cold floor in-process: {floor:.1f} ms")
    bottom.set_yscale("log")
    bottom.set_ylabel("request latency, ms (log)")
    bottom.set_xlabel("request in the trace")
    bottom.legend(loc="upper right", fontsize=8, markerscale=3)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def eviction(data: dict[str, Any], png: Path) -> None:
    """Hit rate per policy per trace, bars, with Belady's as a marker on each trace."""
    plt = _pyplot()
    rows = data["rows"]
    policies = list(data["policies"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(policies)
    for k, name in enumerate(policies):
        xs = [i + (k - (len(policies) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r[name] for r in rows], width, label=data["policies"][name])
    ax.scatter(range(len(rows)), [r["belady"] for r in rows], marker="_", s=900, color="black", zorder=3, label="Belady (offline)")
    if all("exact_lfu" in r for r in rows):
        ax.scatter(range(len(rows)), [r["exact_lfu"] for r in rows], marker="_", s=900, color="grey", zorder=3, label="exact LFU (online reference)")
    ax.set_xticks(range(len(rows)), [r["trace"] for r in rows])
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.grid(axis="y", alpha=0.3)
    s = data["settings"]
    ax.set_title(f"{s['models']} models, room for {s['room']}, {s['requests']} requests per trace", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def compare(report: dict[str, Any], png: Path) -> None:
    """The tiny workload: requests/s and p99 against concurrency, per peer, one column per
    encoding."""
    plt = _pyplot()
    tiny = report["workloads"].get("tiny")
    if not tiny:
        print("no tiny workload in the report: nothing to plot", file=sys.stderr)
        return
    encodings = report["settings"]["encodings"]
    fig, axes = plt.subplots(2, len(encodings), figsize=(5 * len(encodings), 8), squeeze=False)
    for col, encoding in enumerate(encodings):
        top, bottom = axes[0][col], axes[1][col]
        for index, rec in enumerate(tiny["peers"]):
            trials = sorted((t for t in rec["trials"] if t["encoding"] == encoding), key=lambda t: t["concurrency"])
            if not trials:
                continue
            xs = [t["concurrency"] for t in trials]
            style = {"marker": "o", "label": rec["name"], "color": f"C{index}"}  # one colour per peer
            top.plot(xs, [t["req_per_s"] for t in trials], **style)
            bottom.plot(xs, [t["p99_ms"] for t in trials], **style)
        top.set_title(f"{ENCODING_LABEL[encoding]}: requests/s")
        bottom.set_title(f"{ENCODING_LABEL[encoding]}: p99 latency")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(report["settings"]["concurrency"], [str(c) for c in report["settings"]["concurrency"]])
            ax.set_xlabel("concurrency")
            ax.grid(True, alpha=0.3)
        top.set_ylabel("req/s")
        top.set_ylim(bottom=0)
        bottom.set_ylabel("p99 ms")
        bottom.set_yscale("log")
        if top.lines:
            top.legend(fontsize=7)
        else:
            top.text(0.5, 0.5, "no trials", ha="center", transform=top.transAxes)
    env = report["environment"]
    fig.suptitle(f"tiny model, loadgen: {env['nproc']} cores, {env['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def soak(report: dict[str, Any], png: Path) -> None:
    """RSS (with its fitted line), open files, threads and the traffic over the run."""
    plt = _pyplot()
    samples = [s for s in report["samples"] if "rss_mib" in s and not s.get("final")]
    trends = report["analysis"]["trends"]
    warm = report["settings"]["warmup_fraction"] * samples[-1]["t"] / 60 if samples else 0
    minutes = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)

    def series(ax: Any, key: str, label: str, color: str) -> None:
        ax.plot(minutes, [s.get(key) for s in samples], color=color, lw=1, label=label)
        t = trends.get(key)
        if t and "fit_t" in t:
            t0, t1 = t["fit_t"]
            ys = [t["intercept"] + t["slope_per_hour"] / 3600 * x for x in (t0, t1)]
            ax.plot([t0 / 60, t1 / 60], ys, "--", color=color, lw=1,
                    label=f"fit: {t['slope_per_hour']:+.2f}/h, {t['verdict']}")

    series(axes[0], "rss_mib", "RSS", "tab:blue")
    series(axes[0], "rss_minus_models_mib", "RSS minus model memory", "tab:green")
    axes[0].plot(minutes, [s.get("model_memory_mib") for s in samples], color="tab:orange", lw=1,
                 label="model memory (the budget's count)")
    limit = report["analysis"]["server"]["memory_limit_mib"]
    if limit:
        axes[0].axhline(limit, color="tab:orange", ls=":", lw=1, label="model memory limit")
    axes[0].set_ylabel("MiB")
    series(axes[1], "fds", "open files", "tab:purple")
    axes[1].set_ylabel("fds")
    series(axes[2], "threads", "threads", "tab:brown")
    axes[2].set_ylabel("threads")
    rate, loads, errors, xs = [], [], [], []
    for prev, cur in itertools.pairwise(samples):
        dt = cur["t"] - prev["t"]
        if dt <= 0:
            continue
        xs.append(cur["t"] / 60)
        rate.append((sum(cur["requests"].values()) - sum(prev["requests"].values())) / dt)
        key = "quiver_model_loading_time_us_count"
        m0, m1 = prev.get("metrics", {}), cur.get("metrics", {})
        loads.append((m1[key] - m0[key]) / dt if key in m0 and key in m1 else None)
        errors.append(sum(cur["errors"].values()) - sum(prev["errors"].values()))
    axes[3].plot(xs, rate, color="tab:blue", lw=1, label="requests/s (all streams)")
    axes[3].plot(xs, loads, color="tab:orange", lw=1, label="model loads/s")
    bad = [(x, r) for x, r, e in zip(xs, rate, errors, strict=True) if e]
    if bad:
        axes[3].scatter([x for x, _ in bad], [r for _, r in bad], color="red", marker="x", zorder=3, label="interval with errors")
    axes[3].set_ylabel("per second")
    axes[3].set_xlabel("minutes")
    for ax in axes:
        ax.axvspan(0, warm, color="grey", alpha=0.15, lw=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    env = report["environment"]
    fig.suptitle(f"soak: {report['settings']['duration_s'] / 60:g} min, errors {report['analysis']['errors']}; "
                 f"{env['nproc']} cores, {env['date']} (grey: warm-up, not fitted)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


PLOTS: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "batching": batching, "http_throughput": http_throughput, "multi_model": multi_model,
    "compare": compare, "soak": soak, "eviction": eviction,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Draw a benchmark's plot from its JSON (needs matplotlib).")
    parser.add_argument("kind", choices=sorted(PLOTS))
    parser.add_argument("json", type=Path)
    parser.add_argument("png", type=Path)
    args = parser.parse_args(argv)
    args.png.parent.mkdir(parents=True, exist_ok=True)
    PLOTS[args.kind](json.loads(args.json.read_text()), args.png)
    print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
