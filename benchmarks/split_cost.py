"""What splitting a request between a frontend worker process and the model side costs.

Run: ``.venv/bin/python -m benchmarks.split_cost`` from the repository root.

The design issue 17 proposes: frontend workers decode HTTP/gRPC and hand each request to the
one model side over a control channel (tensor bytes in shared memory, descriptors on the
channel). Whether that scales depends on what the hand-off itself costs each side, per request:
the model side must stay well under the cost of a whole request today, or it becomes the new
single-core ceiling. This measures that floor with the channel the Python-worker transport uses
(a Unix socket, 4-byte length + a JSON object per message, asyncio on uvloop at both ends):

* a *model side* process answers every ``infer`` message with a ``response`` message carrying
  an output descriptor, doing nothing else (no scheduling, no model);
* a *worker* process keeps ``--concurrency`` requests in flight on one connection (as one
  frontend worker multiplexes its clients' requests), matching answers by id.

Both processes' CPU time over the measured window, divided by the round trips, is the table:
per codec (the standard library's ``json``, as the transport has it, and ``orjson``) and
concurrency. Writes ``benchmarks/results/split_cost.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from benchmarks import common
from benchmarks.common import ROOT, cpu_seconds, run_async

_LENGTH = struct.Struct("<I")
CODECS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], Any]]] = {
    "json": (lambda m: json.dumps(m, separators=(",", ":")).encode(), json.loads),
    "orjson": (orjson.dumps, orjson.loads),
}
#: An infer request as a frontend worker would send it: tensors as shared-memory descriptors.
REQUEST = {
    "op": "infer", "id": 0, "model": "tiny", "version": "", "request_id": "",
    "inputs": [["INPUT0", "FP32", [1, 16], "quiver-frontend-0-seg0", 4096, 64]],
    "outputs": [["OUTPUT0", {"binary_data": True}]], "parameters": {}, "timeout": 0,
}
RESPONSE = {
    "op": "response", "id": 0, "model": "tiny", "version": "1",
    "outputs": [["OUTPUT0", "FP32", [1, 16], "quiver-model-seg0", 8192, 64]], "parameters": {},
}


class _Framed(asyncio.Protocol):
    """Length-prefixed frames in, ``on_message(decoded)`` for each."""

    def __init__(self, loads: Callable[[bytes], Any]) -> None:
        self.loads = loads
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        while len(buffer) >= 4:
            (length,) = _LENGTH.unpack_from(buffer)
            if len(buffer) < 4 + length:
                break
            message = self.loads(bytes(buffer[4 : 4 + length]))
            del buffer[: 4 + length]
            self.on_message(message)

    def on_message(self, message: Any) -> None:
        raise NotImplementedError


async def serve_model_side(path: str, codec: str) -> None:
    dumps, loads = CODECS[codec]

    class ModelSide(_Framed):
        def on_message(self, message: Any) -> None:
            answer = dict(RESPONSE, id=message["id"])
            body = dumps(answer)
            assert self.transport is not None
            self.transport.write(_LENGTH.pack(len(body)) + body)

    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: ModelSide(loads), path)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


async def drive(path: str, codec: str, concurrency: int, warmup: float, duration: float, pid: int) -> dict[str, float]:
    dumps, loads = CODECS[codec]
    loop = asyncio.get_running_loop()
    waiting: dict[int, asyncio.Future[Any]] = {}

    class Worker(_Framed):
        def on_message(self, message: Any) -> None:
            waiting.pop(message["id"]).set_result(message)

    transport, _ = await loop.create_unix_connection(lambda: Worker(loads), path)
    state = {"count": 0, "stop": False, "next": 0}

    async def caller() -> None:
        while not state["stop"]:
            state["next"] += 1
            ident = state["next"]
            future = loop.create_future()
            waiting[ident] = future
            body = dumps(dict(REQUEST, id=ident))
            transport.write(_LENGTH.pack(len(body)) + body)
            await future
            state["count"] += 1

    tasks = [asyncio.create_task(caller()) for _ in range(concurrency)]
    await asyncio.sleep(warmup)
    n0, c0, s0, t0 = state["count"], time.process_time(), cpu_seconds(pid), time.perf_counter()
    await asyncio.sleep(duration)
    n1, c1, s1, t1 = state["count"], time.process_time(), cpu_seconds(pid), time.perf_counter()
    state["stop"] = True
    await asyncio.gather(*tasks)
    transport.close()
    trips = n1 - n0
    return {
        "round_trips_per_s": trips / (t1 - t0),
        "worker_us": 1e6 * (c1 - c0) / trips,
        "model_side_us": 1e6 * (s1 - s0) / trips,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-model-side", metavar="SOCKET", help=argparse.SUPPRESS)
    parser.add_argument("--codec", default="json", choices=sorted(CODECS), help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.serve_model_side:
        run_async(serve_model_side(args.serve_model_side, args.codec))
        return 0
    levels = [int(c) for c in args.concurrency.split(",")]
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    folder = Path(tempfile.mkdtemp(prefix="split_cost-"))
    for round_ in range(args.repeat):
        for codec in CODECS:
            path = str(folder / f"{codec}-{round_}.sock")
            side = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.split_cost", "--serve-model-side", path, "--codec", codec],
                cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            try:
                assert side.stdout is not None
                if side.stdout.readline().strip() != b"ready":
                    raise SystemExit("the model side did not start")
                for c in levels:
                    got = run_async(drive(path, codec, c, args.warmup, args.duration, side.pid))
                    samples.setdefault((codec, c), []).append(got)
                    print(f"[split_cost] round {round_ + 1} {codec} c={c}: {got}", file=sys.stderr, flush=True)
            finally:
                side.terminate()
                side.wait(10)
    lines = [
        "| codec | c | round trips/s | worker CPU us per request | model side CPU us per request |",
        "|---|---:|---:|---:|---:|",
    ]
    rows = []
    for (codec, c), got in samples.items():
        med = {k: statistics.median(s[k] for s in got) for k in got[0]}
        lines.append(f"| {codec} | {c} | {med['round_trips_per_s']:,.0f} | {med['worker_us']:.1f} | {med['model_side_us']:.1f} |")
        rows.append({"codec": codec, "concurrency": c, "median": med, "samples": got})
    markdown = "\n".join(lines)
    print(markdown)
    header = (
        "# Frontend worker <-> model side: the hand-off's own cost\n\n"
        f"`{common.command_line()}`\n\n{args.duration:g} s per trial after {args.warmup:g} s, "
        f"{args.repeat} rounds; medians.\n\n"
    )
    report = {"command": common.command_line(), "environment": common.environment(("uvloop", "orjson")), "rows": rows}
    print(common.write_results(args.output_dir, "split_cost", header + markdown, report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
