"""A streaming (decoupled) model: time to first response and responses per second, over gRPC
streaming (``ModelStreamInfer`` with tritonclient) and Server-Sent Events (``generate_stream``
with a plain HTTP client), with the Python model in a worker process (the default) and in the
server's process.

The model (``bench_streamer``, decoupled) answers a request for COUNT tokens with COUNT
responses of one INT32 each, sent from ``execute`` as fast as it can, then the final flag.

- **time to first response**: a request for 64 tokens, from sending it to its first response
  (median and p99 of ``--requests`` requests, one at a time);
- **responses/s**: requests for ``--tokens`` tokens, one at a time: responses over the time
  from sending to the final flag (median of ``--repeat`` requests).

gRPC is read two ways: with ``tritonclient.grpc``'s stream (what users run; its callback
builds an ``InferResult`` per response) and with grpcio's generated stub (the server's side
with the least client cost). SSE is read with ``http.client``.

Run: ``python -m benchmarks.streaming [--requests 200] [--tokens 2000] [--repeat 5]``.
Writes ``benchmarks/results/streaming.{md,json}``.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from benchmarks.common import command_line, environment, write_results
from benchmarks.peers.quiver import QuiverServer

HERE = Path(__file__).resolve().parent
FIRST_TOKENS = 64

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(count):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("TOKEN", np.array([i], dtype=np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

CONFIG = """
name: "bench_streamer"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def build(root: Path) -> Path:
    folder = root / "models" / "bench_streamer"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(MODEL)
    (folder / "config.pbtxt").write_text(CONFIG)
    return root / "models"


class GrpcStream:
    """One tritonclient gRPC stream; each response arrives with the time it arrived."""

    def __init__(self, address: str) -> None:
        self.client = grpcclient.InferenceServerClient(address)
        self.arrivals: queue.Queue[tuple[float, Any, Any]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.arrivals.put((time.perf_counter(), result, error)))

    def request(self, count: int) -> tuple[float, float, int]:
        """(seconds to the first response, seconds to the final flag, responses)."""
        inp = grpcclient.InferInput("COUNT", [1], "INT32")
        inp.set_data_from_numpy(np.array([count], dtype=np.int32))
        start = time.perf_counter()
        self.client.async_stream_infer("bench_streamer", [inp], enable_empty_final_response=True)
        first = 0.0
        responses = 0
        while True:
            arrived, result, error = self.arrivals.get(timeout=120)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if response.outputs:
                responses += 1
                if responses == 1:
                    first = arrived - start
            if response.parameters["triton_final_response"].bool_param:
                return first, arrived - start, responses

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


class RawGrpcStream:
    """ModelStreamInfer with grpcio's own stub (no tritonclient result objects): the
    server's side without the client library's per-response cost."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.outgoing: queue.Queue[Any] = queue.Queue()
        self.responses = stub.ModelStreamInfer(iter(self.outgoing.get, None))

    def request(self, count: int) -> tuple[float, float, int]:
        message = pb.ModelInferRequest(model_name="bench_streamer")
        message.inputs.add(name="COUNT", datatype="INT32", shape=[1])
        message.raw_input_contents.append(np.array([count], dtype=np.int32).tobytes())
        message.parameters["triton_enable_empty_final_response"].bool_param = True
        start = time.perf_counter()
        self.outgoing.put(message)
        first = 0.0
        responses = 0
        for answer in self.responses:
            if answer.error_message:
                raise RuntimeError(answer.error_message)
            if answer.infer_response.outputs:
                responses += 1
                if responses == 1:
                    first = time.perf_counter() - start
            if answer.infer_response.parameters["triton_final_response"].bool_param:
                break
        return first, time.perf_counter() - start, responses

    def close(self) -> None:
        self.outgoing.put(None)
        self.channel.close()


class Sse:
    """generate_stream on one keep-alive HTTP connection."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)

    def request(self, count: int) -> tuple[float, float, int]:
        start = time.perf_counter()
        self.conn.request(
            "POST", "/v2/models/bench_streamer/generate_stream", body=json.dumps({"COUNT": count}),
            headers={"Content-Type": "application/json"},
        )
        response = self.conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"generate_stream answered {response.status}: {response.read()[:200]!r}")
        first = 0.0
        responses = 0
        while line := response.readline():
            if line.startswith(b"data: "):
                responses += 1
                if responses == 1:
                    first = time.perf_counter() - start
        return first, time.perf_counter() - start, responses

    def close(self) -> None:
        self.conn.close()


def measure(client: GrpcStream | RawGrpcStream | Sse, args: argparse.Namespace) -> dict[str, Any]:
    for _ in range(10):  # warm-up
        client.request(FIRST_TOKENS)
    firsts = [client.request(FIRST_TOKENS)[0] for _ in range(args.requests)]
    rates = []
    for _ in range(args.repeat):
        _, total, responses = client.request(args.tokens)
        if responses != args.tokens:
            raise RuntimeError(f"expected {args.tokens} responses, got {responses}")
        rates.append(responses / total)
    firsts.sort()
    return {
        "first_ms_median": statistics.median(firsts) * 1000,
        "first_ms_p99": firsts[min(len(firsts) - 1, int(len(firsts) * 0.99))] * 1000,
        "responses_per_s": statistics.median(rates),
        "responses_per_s_all": rates,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests timed for the first response")
    parser.add_argument("--tokens", type=int, default=2000, help="responses per request for responses/s")
    parser.add_argument("--repeat", type=int, default=5, help="requests timed for responses/s")
    parser.add_argument("--output-dir", type=Path, default=HERE / "results")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="quiver-streaming-") as tmp:
        repo = build(Path(tmp))
        for mode, flags in (("worker", []), ("in-process", ["--backend-config=python,in-process=true"])):
            with QuiverServer(repo, flags, log=Path(tmp) / f"server-{mode}.log") as server:
                endpoints = server.endpoints
                assert endpoints.grpc is not None and endpoints.http is not None
                clients: list[tuple[str, Any]] = [
                    ("gRPC stream (tritonclient)", functools.partial(GrpcStream, endpoints.grpc)),
                    ("gRPC stream (grpcio stub)", functools.partial(RawGrpcStream, endpoints.grpc)),
                    ("SSE (http.client)", functools.partial(Sse, endpoints.http)),
                ]
                for transport, make in clients:
                    client = make()
                    try:
                        print(f"measuring {transport}, Python model {mode}...", file=sys.stderr)
                        rows.append({"transport": transport, "python_model": mode, **measure(client, args)})
                    finally:
                        client.close()
    lines = [
        "# Streaming: time to first response and responses per second",
        "",
        f"`{command_line()}`. One decoupled Python model sending one INT32 per response; one request at "
        f"a time. First response: a {FIRST_TOKENS}-token request, median and p99 of {args.requests}. "
        f"Responses/s: {args.tokens}-token requests, median of {args.repeat}.",
        "",
        "| transport | Python model | first response, median ms | first response, p99 ms | responses/s |",
        "|---|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['transport']} | {row['python_model']} | {row['first_ms_median']:.2f} | "
            f"{row['first_ms_p99']:.2f} | {row['responses_per_s']:,.0f} |"
        )
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    report = {"settings": vars(args) | {"output_dir": str(args.output_dir)}, "rows": rows,
              "environment": environment(["tritonclient", "grpcio", "uvicorn"])}
    print(write_results(args.output_dir, "streaming", markdown, report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
