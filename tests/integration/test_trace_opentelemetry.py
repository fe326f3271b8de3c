"""``--trace-config mode=opentelemetry``: Triton's spans exported over OTLP/HTTP, received
here by a small OTLP/HTTP receiver that decodes the protobuf export requests."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from support.models import write_config
from support.server import QuiverServer

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs quiver[trace]")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from test_trace import BATCHED, ENSEMBLE, IDENTITY

TRACE_ID = "0af7651916cd43dd8448eb211c12666c"
PARENT_SPAN = "b7ad6b7169242424"
GRPC_TRACE_ID = "1bf7651916cd43dd8448eb211c12666d"


class Receiver:
    """Collects the spans (with their resource attributes) POSTed to /v1/traces."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, str], Any]] = []
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.paths.append(self.path)
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    for scope in resource_spans.scope_spans:
                        outer.spans.extend((resource, span) for span in scope.spans)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def traces(self) -> dict[bytes, list[Any]]:
        by_trace: dict[bytes, list[Any]] = defaultdict(list)
        for _, span in self.spans:
            by_trace[span.trace_id].append(span)
        return by_trace


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    receiver.thread.start()
    yield receiver
    receiver.server.shutdown()
    receiver.server.server_close()


def _events(span: Any) -> list[str]:
    return [event.name for event in span.events]


def _tree(spans: list[Any]) -> dict[str, list[str]]:
    names = {span.span_id: span.name for span in spans}
    tree: dict[str, list[str]] = defaultdict(list)
    for span in spans:
        if span.parent_span_id in names:
            tree[names[span.parent_span_id]].append(span.name)
    return {parent: sorted(children) for parent, children in tree.items()}


def test_spans_exported_over_otlp_http(tmp_path: Path, receiver: Receiver) -> None:
    repo = tmp_path / "repo"
    write_config(repo, "simple", IDENTITY)
    write_config(repo, "batched", BATCHED)
    write_config(repo, "pipeline", ENSEMBLE)
    args = (
        "--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS",
        "--trace-config", "rate=1",
        "--trace-config", f"opentelemetry,url=127.0.0.1:{receiver.port}/v1/traces",
        "--trace-config", "opentelemetry,resource=test.key=test.value",
        "--trace-config", "opentelemetry,resource=service.name=test_quiver",
        "--trace-config", "opentelemetry,bsp_schedule_delay=50",
    )  # fmt: skip
    data = np.ones((1, 4), dtype=np.float32)
    with QuiverServer(repo, args=args) as server:
        with httpclient.InferenceServerClient(server.url) as client:
            settings = client.get_trace_settings()
            assert settings["trace_mode"] == "opentelemetry"
            assert settings["url"] == f"127.0.0.1:{receiver.port}/v1/traces"
            assert settings["bsp_schedule_delay"] == "50"
            assert "trace_file" not in settings and "log_frequency" not in settings
            tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            tensor.set_data_from_numpy(data)
            client.infer("simple", [tensor], request_id="r1")
            client.infer("simple", [tensor], headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"})
            ensemble_input = httpclient.InferInput("IN", [1, 4], "FP32")
            ensemble_input.set_data_from_numpy(data)
            client.infer("pipeline", [ensemble_input])
        with grpcclient.InferenceServerClient(server.grpc_url) as grpc_client:
            grpc_tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
            grpc_tensor.set_data_from_numpy(data)
            grpc_client.infer("simple", [grpc_tensor])
            grpc_client.infer("simple", [grpc_tensor], headers={"traceparent": f"00-{GRPC_TRACE_ID}-{PARENT_SPAN}-01"})
    # The server flushed its spans at stop.
    assert set(receiver.paths) == {"/v1/traces"}
    resource = receiver.spans[0][0]
    assert resource["service.name"] == "test_quiver"
    assert resource["test.key"] == "test.value"
    traces = list(receiver.traces().values())
    assert len(traces) == 5
    by_model: dict[str, list[list[Any]]] = defaultdict(list)
    for spans in traces:
        root = next(s for s in spans if s.name == "InferRequest")
        model = next(s.name for s in spans if s.parent_span_id == root.span_id)
        by_model[model].append(spans)

    http_plain, http_propagated, grpc_trace, grpc_propagated = by_model["simple"]
    for spans in (http_plain, http_propagated, grpc_trace, grpc_propagated):
        assert sorted(s.name for s in spans) == ["InferRequest", "compute", "simple"]
        assert _tree(spans) == {"InferRequest": ["simple"], "simple": ["compute"]}
        model_span = next(s for s in spans if s.name == "simple")
        assert _events(model_span) == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
        attributes = {a.key: a.value for a in model_span.attributes}
        assert attributes["triton.model_name"].string_value == "simple"
        assert attributes["triton.model_version"].int_value == -1
        compute = next(s for s in spans if s.name == "compute")
        assert _events(compute) == ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]
        assert compute.start_time_unix_nano <= compute.end_time_unix_nano
    root = next(s for s in http_plain if s.name == "InferRequest")
    assert _events(root) == ["HTTP_RECV_START", "HTTP_RECV_END", "INFER_RESPONSE_COMPLETE", "HTTP_SEND_START", "HTTP_SEND_END"]
    assert root.parent_span_id == b""
    model_span = next(s for s in http_plain if s.name == "simple")
    assert {a.key: a.value.string_value for a in model_span.attributes}["triton.request_id"] == "r1"
    # The client's traceparent: same trace, the root span a child of the client's span.
    propagated_root = next(s for s in http_propagated if s.name == "InferRequest")
    assert propagated_root.trace_id.hex() == TRACE_ID
    assert propagated_root.parent_span_id.hex() == PARENT_SPAN
    grpc_propagated_root = next(s for s in grpc_propagated if s.name == "InferRequest")
    assert grpc_propagated_root.trace_id.hex() == GRPC_TRACE_ID  # from the call's metadata
    assert grpc_propagated_root.parent_span_id.hex() == PARENT_SPAN
    grpc_root = next(s for s in grpc_trace if s.name == "InferRequest")
    assert set(_events(grpc_root)) == {
        "GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "INFER_RESPONSE_COMPLETE", "GRPC_SEND_START", "GRPC_SEND_END",
    }  # fmt: skip

    (ensemble,) = by_model["pipeline"]
    assert _tree(ensemble) == {
        "InferRequest": ["pipeline"],
        "pipeline": ["batched", "simple"],
        "simple": ["compute"],
        "batched": ["compute"],
    }
    parent_id = {a.key: a.value.int_value for a in next(s for s in ensemble if s.name == "pipeline").attributes}
    step = next(s for s in ensemble if s.name == "simple")
    assert {a.key: a.value.int_value for a in step.attributes}["triton.trace_parent_id"] == parent_id["triton.trace_id"]
