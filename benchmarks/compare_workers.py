"""The frontend-worker part of ``benchmarks.compare``: issue 17's targets judged on the tiny
workload (Quiver with and without ``--frontend-workers`` against Triton), and the scaling
workload (``benchmarks.http_workers``: requests/s and CPU per request for 0, 2, ... workers).

Kept apart from ``compare.py``, which imports it: the peers' trials come in as the records
``compare._run_peer`` makes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.plots import ENCODING_LABEL

QUIVER_WORKERS, QUIVER_ONNX_WORKERS = "quiver-python-workers", "quiver-onnx-workers"
PEERS = (QUIVER_WORKERS, QUIVER_ONNX_WORKERS)
TARGET = (
    "Tiny model as Triton's Python model with its unchanged config (and as ONNX): Quiver >= 1.0x "
    "Triton in requests/s at concurrency 8 and 32, over HTTP binary and gRPC, with p99 no worse than Triton's."
)
ENCODINGS = ("binary", "grpc")
CONCURRENCY = (8, 32)
WORKLOAD = "frontend-workers"

Trial = dict[str, Any] | None
TrialOf = Callable[[str, str, int], Trial]  # (peer key, encoding, concurrency) -> its trial


def default_workers() -> int:
    """The worker count the comparison runs: one per core this process may use, at least 2."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 2
    return max(2, cores)


def verdicts(trial: TrialOf, quiver: str, quiver_onnx: str, triton: str) -> list[dict[str, Any]]:
    """Per (encoding, concurrency): Triton's req/s and p99, each Quiver variant's (single process
    and with workers), the better of the Python model's two, and the verdicts on it."""
    cells = []
    for encoding in ENCODINGS:
        for concurrency in CONCURRENCY:
            theirs = trial(triton, encoding, concurrency)
            variants = {
                "python": trial(quiver, encoding, concurrency),
                "python, workers": trial(QUIVER_WORKERS, encoding, concurrency),
                "onnx": trial(quiver_onnx, encoding, concurrency),
                "onnx, workers": trial(QUIVER_ONNX_WORKERS, encoding, concurrency),
            }
            cell: dict[str, Any] = {
                "encoding": encoding, "concurrency": concurrency,
                "triton": _pick(theirs), "variants": {k: _pick(v) for k, v in variants.items()},
            }
            for kind in ("python", "onnx"):
                measured = [(k, v) for k, v in variants.items() if k.startswith(kind) and _clean(v)]
                if theirs is None or not _clean(theirs) or not measured:
                    cell[kind] = {"verdict": "NOT MEASURED"}
                    continue
                best_key, best = max(measured, key=lambda kv: kv[1]["req_per_s"])  # type: ignore[index]
                assert best is not None
                rate = best["req_per_s"] / theirs["req_per_s"]
                tail = best["p99_ms"] / theirs["p99_ms"] if theirs["p99_ms"] else None
                cell[kind] = {
                    "best": best_key, "req_per_s_ratio": rate, "p99_ratio": tail,
                    "verdict": "MET" if rate >= 1.0 and tail is not None and tail <= 1.0 else "MISSED",
                }
            cells.append(cell)
    return cells


def _pick(trial: Trial) -> dict[str, Any] | None:
    if trial is None:
        return None
    return {k: trial.get(k) for k in ("req_per_s", "p99_ms", "errors", "server_cpu_pct", "client_cpu_pct")}


def _clean(trial: Trial) -> bool:
    return trial is not None and not trial.get("errors") and bool(trial.get("req_per_s"))


def _num(value: float | None, digits: int = 0) -> str:
    return common.dash(value, f",.{digits}f")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


_table = common.markdown_table


def markdown(cells: list[dict[str, Any]], workers: int) -> list[str]:
    lines = [
        f"### Issue 17's targets: {TARGET}", "",
        f"Quiver single-process and with `--frontend-workers {workers}` (same model, same config); the verdict "
        "takes the better of the two for each model kind and asks for both its req/s >= Triton's and its "
        "p99 <= Triton's. Ratios: Quiver over Triton.", "",
    ]
    rows = []
    for cell in cells:
        t = cell["triton"] or {}
        v = cell["variants"]
        row = [ENCODING_LABEL[cell["encoding"]], str(cell["concurrency"]), _num(t.get("req_per_s")), _num(t.get("p99_ms"), 3)]
        for key in ("python", "python, workers", "onnx", "onnx, workers"):
            trial = v.get(key) or {}
            row += [_num(trial.get("req_per_s")), _num(trial.get("p99_ms"), 3)]
        for kind in ("python", "onnx"):
            judged = cell[kind]
            if judged["verdict"] == "NOT MEASURED":
                row.append("not measured")
            else:
                row.append(f"**{judged['verdict']}** ({judged['best']}: {_ratio(judged['req_per_s_ratio'])} req/s, "
                           f"{_ratio(judged['p99_ratio'])} p99)")
        rows.append(row)
    lines += _table(
        ["encoding", "c", "Triton req/s", "p99 ms", "Quiver python req/s", "p99 ms", "python, workers req/s",
         "p99 ms", "Quiver onnx req/s", "p99 ms", "onnx, workers req/s", "p99 ms", "python verdict", "onnx verdict"],
        rows, "lr" + "r" * 10 + "ll",
    )
    return [*lines, ""]


# -- the scaling workload (benchmarks.http_workers as a subprocess) ---------------------------


def script_argv(workers: int, duration: float, warmup: float, quick: bool, out: Path) -> tuple[str, list[str], str]:
    counts = "0,2" if quick else ",".join(str(n) for n in [0, *range(2, workers + 3)])
    return "benchmarks.http_workers", [
        "--workers", counts, "--backends", "onnx,python", "--encodings", "binary,grpc",
        "--concurrency", "8,32", "--duration", f"{max(1.0, duration / 2):g}", "--warmup", f"{max(0.5, warmup):g}",
        "--repeat", "1" if quick else "2", "--output-dir", str(out), "--output-name", "frontend_workers",
    ], "frontend_workers.json"


def summary(data: dict[str, Any]) -> dict[str, Any]:
    rows = [{"model": r["model"], "encoding": r["encoding"], "workers": r["workers"], "concurrency": r["concurrency"],
             **r["median"]} for r in data["rows"]]
    rows.sort(key=lambda r: (r["model"], r["encoding"], r["concurrency"], r["workers"]))
    return {"rows": rows}


def markdown_script(summary_: dict[str, Any]) -> list[str]:
    lines = [
        "Requests/s and server CPU per request for 0 (the single-process server), 2, ... frontend workers, "
        "split by process: the model side (the server process), the frontend workers, the Python model's "
        "own process. The model side is the one part that does not grow with workers, so 1e6 / its "
        "microseconds per request (`model-side ceiling`) is about where a machine with more cores would "
        "stop gaining.", "",
    ]
    rows = [[r["model"], ENCODING_LABEL.get(r["encoding"], r["encoding"]), str(r["workers"]), str(r["concurrency"]),
             _num(r["req_per_s"]), _num(r["p99_ms"], 2), _num(r["server_us"]), _num(r.get("model_side_us")),
             _num(r.get("frontend_us")), _num(r.get("model_processes_us")), _num(r.get("model_side_ceiling_req_per_s"))]
            for r in summary_["rows"]]
    lines += _table(["model", "encoding", "workers", "c", "req/s", "p99 ms", "server CPU us/request", "model side us",
                     "frontend workers us", "Python model process us", "model-side ceiling req/s"], rows, "llrr" + "r" * 7)
    return [*lines, ""]


__all__ = ["PEERS", "QUIVER_ONNX_WORKERS", "QUIVER_WORKERS", "TARGET", "WORKLOAD", "default_workers",
           "markdown", "markdown_script", "script_argv", "summary", "verdicts"]
