"""Triton's ``perf_analyzer`` against Quiver with ``--shared-memory system`` next to the plain run.

perf_analyzer creates one system shared-memory region per input and output, registers them
with the server (``/v2/systemsharedmemory/region/.../register`` or gRPC
``SystemSharedMemoryRegister``), and sends requests that name the regions instead of carrying
the tensors; the server reads the inputs from and writes the outputs into the regions. The
plain run sends the same tensors in the request and gets them back in the response.

The model is an ONNX ``Identity`` over one FP32 tensor (so the server's own work is mostly
moving the tensor), at two sizes: 4 KiB and 1 MiB. Both runs use the same server, started with
``--allow-client-shm=true``, and the same concurrency; the table compares them row by row.

Run from the repository root::

    .venv/bin/python -m benchmarks.shared_memory [--concurrency 1 4] [--measurement-ms 3000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, helper

from benchmarks import perf_analyzer
from benchmarks.common import command_line, environment, write_results
from benchmarks.peers.quiver import QuiverServer

RESULTS = Path(__file__).resolve().parent / "results"
#: model name -> FP32 elements of its one input (and output)
SIZES = {"identity_4k": 1024, "identity_1m": 262144}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _write_model(repo: Path, name: str, elements: int) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [elements])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [elements])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    onnx.save(model, str(folder / "1" / "model.onnx"))
    (folder / "config.pbtxt").write_text(
        textwrap.dedent(
            f"""
            name: "{name}"
            platform: "onnxruntime_onnx"
            max_batch_size: 0
            input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {elements} ] }} ]
            output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {elements} ] }} ]
            instance_group [ {{ count: 1 kind: KIND_CPU }} ]
            """
        )
    )


def measure(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    repo = folder / "models"
    for name, elements in SIZES.items():
        _write_model(repo, name, elements)
    rows: list[dict[str, Any]] = []
    with QuiverServer(repo, ["--allow-client-shm=true"], log=folder / "server.log") as server:
        for protocol in args.protocols:
            url = str(server.endpoints.http if protocol == "http" else server.endpoints.grpc)
            for model, elements in SIZES.items():
                tensor_bytes = elements * 4
                for concurrency in args.concurrency:
                    for mode in ("plain", "system"):
                        extra = []
                        if mode == "system":
                            extra = ["--shared-memory", "system", "--output-shared-memory-size", str(tensor_bytes)]
                        log(f"perf_analyzer {protocol} {model} c={concurrency} {mode} ...")
                        result = perf_analyzer.run(
                            url=url, protocol=protocol, model=model, concurrency=concurrency,
                            measurement_ms=args.measurement_ms, max_trials=args.max_trials,
                            stability_percentage=args.stability, extra_args=extra,
                        )  # fmt: skip
                        rows.append(
                            {
                                "protocol": protocol,
                                "model": model,
                                "tensor_bytes": tensor_bytes,
                                "concurrency": concurrency,
                                "shared_memory": mode,
                                **result,
                            }
                        )
                        log(f"  {result['req_per_s']:,.0f} req/s, p50 {result['p50_ms']:.3f} ms")
    return rows


def markdown(rows: list[dict[str, Any]], report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# perf_analyzer with `--shared-memory system` against Quiver",
        "",
        f"`{report['command']}` on {env['date']}, {env['nproc']} cores ({env['cpu_model']}), "
        f"perf_analyzer {report['perf_analyzer']}. One Quiver server "
        "(`--allow-client-shm=true`), an ONNX Identity over one FP32 tensor; each row is the "
        "plain run (tensors in the request and the response) next to `--shared-memory system` "
        "(tensors in regions the client registered), same concurrency, same server.",
        "",
        "| protocol | tensor | concurrency | plain req/s | shm req/s | shm / plain | plain p50 ms | shm p50 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_key: dict[tuple[str, str, int], dict[str, dict[str, Any]]] = {}
    for row in rows:
        key = (row["protocol"], row["model"], row["concurrency"])
        by_key.setdefault(key, {})[row["shared_memory"]] = row
    for (protocol, _model, concurrency), pair in by_key.items():
        plain, shm = pair["plain"], pair["system"]
        size = plain["tensor_bytes"]
        label = f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        lines.append(
            f"| {protocol} | {label} | {concurrency} | {plain['req_per_s']:,.0f} | "
            f"{shm['req_per_s']:,.0f} | {shm['req_per_s'] / plain['req_per_s']:.2f} | "
            f"{plain['p50_ms']:.3f} | {shm['p50_ms']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.shared_memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--protocols", nargs="+", choices=["http", "grpc"], default=["http", "grpc"])
    parser.add_argument("--measurement-ms", type=int, default=3000)
    parser.add_argument("--max-trials", type=int, default=10, help="measurement windows at most")
    parser.add_argument(
        "--stability", type=float, default=50, help="percent three windows in a row must agree within"
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    install = perf_analyzer.setup()
    with tempfile.TemporaryDirectory(prefix="quiver-shm-bench-") as tmp:
        try:
            rows = measure(args, Path(tmp))
        except perf_analyzer.PerfAnalyzerError as exc:
            print(f"perf_analyzer failed: {exc}", file=sys.stderr)
            server_log = Path(tmp) / "server.log"
            if server_log.exists():
                print(server_log.read_text(errors="replace")[-3000:], file=sys.stderr)
            return 1
    report = {
        "command": command_line(),
        "environment": environment(["onnxruntime", "numpy"]),
        "perf_analyzer": install.versions.get("perf-analyzer", "unknown"),
        "rows": rows,
    }
    text = markdown(rows, report)
    print(text)
    log(write_results(args.output_dir, "shared_memory", text, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
