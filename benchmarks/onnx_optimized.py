"""Creating an ONNX Runtime session from a model's own file, against from its kept optimized graph.

What ``backends/onnxruntime_optimized.py`` saves at each load after a model's first: the
server's session options (the process's shared thread pools, as in ``on_demand``), the
model's own file opened at ONNX Runtime's ``all`` level (what every load did before), and the
copy the optimizer process wrote, opened with optimizations off. Each timing is the session's
creation and its first run, taken after a pause (``--pause``, 30 ms by default, as the
multi-model benchmark pauses after a miss: the session-creating code is then out of the CPU's
caches, as it is in the server), the two alternating. Also: the copy's answers against the
model's (largest absolute difference) and a run's time once created (the copy must not run
slower).

Models: the multi-model benchmark's tiny one (an Add of a constant), and ResNet-50 and MiniLM
from the example repository when it is built (``make serve`` or ``python
examples/build_repository.py examples/model_repository``).

    python -m benchmarks.onnx_optimized [--rounds 20] [--repository examples/model_repository]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common

RESULTS = common.ROOT / "benchmarks" / "results"


def feeds(session: Any) -> dict[str, np.ndarray]:
    """A deterministic input for each of the session's inputs (batch 1, variable dims 16)."""
    rng = np.random.default_rng(0)
    out = {}
    for node in session.get_inputs():
        shape = [d if isinstance(d, int) and d > 0 else (1 if i == 0 else 16) for i, d in enumerate(node.shape)]
        if node.type == "tensor(int64)":
            out[node.name] = rng.integers(1, 100, size=shape).astype(np.int64)
        else:
            out[node.name] = rng.random(shape, dtype=np.float32)
    return out


def measure(name: str, source: Path, rounds: int, pause: float, runs: int) -> dict[str, Any]:
    import onnxruntime as ort

    from quiver.backends.onnxruntime_optimized import OptimizedModels

    with tempfile.TemporaryDirectory(prefix="quiver-optimized-") as tmp:
        kept = OptimizedModels(Path(tmp))
        key = kept.key(str(source), "all")
        assert key is not None, f"{source} is not a file to keep a copy of"
        started = time.monotonic()
        kept.submit(str(source), "all", key)
        assert kept.wait_idle(600)
        made_s = time.monotonic() - started
        copy = kept.find(key)
        kept.stop()
        assert copy is not None, f"the optimizer kept no copy of {source}"

        def options(optimized: bool) -> Any:
            made = ort.SessionOptions()
            made.use_per_session_threads = False
            made.log_severity_level = 3
            made.graph_optimization_level = (
                ort.GraphOptimizationLevel.ORT_DISABLE_ALL if optimized else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            )
            return made

        def open_and_run(path: str, optimized: bool) -> tuple[float, float, Any, np.ndarray]:
            t0 = time.perf_counter()
            session = ort.InferenceSession(path, sess_options=options(optimized), providers=["CPUExecutionProvider"])
            t1 = time.perf_counter()
            first = session.run(None, feeds(session))[0]
            return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3, session, np.asarray(first)

        own: list[float] = []
        from_copy: list[float] = []
        own_create: list[float] = []
        copy_create: list[float] = []
        for _ in range(rounds):
            for path, optimized, into, created in ((str(source), False, own, own_create), (copy, True, from_copy, copy_create)):
                time.sleep(pause)
                create_ms, ms, session, _ = open_and_run(path, optimized)
                into.append(ms)
                created.append(create_ms)
                del session
        _, _, own_session, own_out = open_and_run(str(source), False)
        _, _, copy_session, copy_out = open_and_run(copy, True)

        def run_ms(session: Any) -> float:
            feed = feeds(session)
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                session.run(None, feed)
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)

        run_own = [run_ms(own_session), run_ms(own_session)]
        run_copy = [run_ms(copy_session), run_ms(copy_session)]
        return {
            "model": name,
            "file_bytes": source.stat().st_size,
            "copy_made_s": made_s,
            "own_ms": own,
            "copy_ms": from_copy,
            "own_p50_ms": statistics.median(own),
            "copy_p50_ms": statistics.median(from_copy),
            "own_create_ms": own_create,
            "copy_create_ms": copy_create,
            "own_create_p50_ms": statistics.median(own_create),
            "copy_create_p50_ms": statistics.median(copy_create),
            "max_abs_diff": float(np.max(np.abs(own_out.astype(np.float64) - copy_out.astype(np.float64)))),
            "run_own_ms": min(run_own),
            "run_copy_ms": min(run_copy),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="timings of each kind per model (default: 20)")
    parser.add_argument("--pause", type=float, default=0.03, help="seconds before each timing (default: 0.03)")
    parser.add_argument(
        "--repository", type=Path, default=common.ROOT / "examples" / "model_repository",
        help="the built example repository, for ResNet-50 and MiniLM (default: examples/model_repository)",
    )  # fmt: skip
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    args = parser.parse_args()

    import onnxruntime as ort

    ort.set_global_thread_pool_sizes(0, 0)  # the server's on_demand sessions share the pools
    rows = []
    with tempfile.TemporaryDirectory(prefix="quiver-optimized-models-") as tmp:
        from benchmarks.multi_model import model

        tiny = Path(tmp) / "tiny.onnx"
        tiny.write_bytes(model(1.0))
        sources = [("tiny (Add, multi-model benchmark)", tiny, 200)]
        for name, folder in (("ResNet-50", "resnet50_onnx"), ("MiniLM-L6", "minilm")):
            path = args.repository / folder / "1" / "model.onnx"
            if path.is_file():
                sources.append((name, path, 10))
            else:
                print(f"{path} not built: {name} left out")
        for name, path, runs in sources:
            print(f"{name}: {args.rounds} rounds")
            rows.append(measure(name, path, args.rounds, args.pause, runs))

    table = common.markdown_table(
        ["model", "file MB", "session created, own file (optimized as it opens) p50 ms", "from the kept copy p50 ms",
         "ratio", "created and run once: own / copy p50 ms", "ratio", "copy made in s (once)", "run ms own / copy",
         "largest difference"],
        [[r["model"], f"{r['file_bytes'] / 1e6:.1f}", f"{r['own_create_p50_ms']:.2f}", f"{r['copy_create_p50_ms']:.2f}",
          f"{r['copy_create_p50_ms'] / r['own_create_p50_ms']:.2f}x",
          f"{r['own_p50_ms']:.2f} / {r['copy_p50_ms']:.2f}",
          f"{r['copy_p50_ms'] / r['own_p50_ms']:.2f}x", f"{r['copy_made_s']:.2f}",
          f"{r['run_own_ms']:.3f} / {r['run_copy_ms']:.3f}", f"{r['max_abs_diff']:.1e}"] for r in rows],
    )  # fmt: skip
    env = common.environment(["onnxruntime"])
    markdown = "\n".join([
        "# ONNX Runtime sessions: the model's own file against its kept optimized graph",
        "",
        f"- Command: `{common.command_line()}`",
        f"- {env.get('date', '')}; {args.rounds} alternating timings of each after a {args.pause * 1e3:.0f} ms pause; "
        "the server's session options (shared thread pools); the kept copy opened with optimizations off.",
        "",
        *table,
    ])  # fmt: skip
    print(markdown)
    print(common.write_results(args.output_dir, "onnx_optimized", markdown, {"environment": env, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
