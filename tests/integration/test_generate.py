"""The generate extension over plain HTTP: generate (one JSON answer) and generate_stream
(Server-Sent Events), Triton's JSON mapping and error messages, zero/one/many responses,
errors mid-stream, a client that disconnects mid-stream, response parameters, user
``is_ready()``, and /infer refusing decoupled models; on one process and through frontend
workers."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from support.decoupled_models import build_decoupled_repository
from support.server import QuiverServer


@pytest.fixture(scope="module", params=["one-process", "frontend-workers"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    """Every test runs on one process and through frontend workers, where generate is
    answered by the model side and generate_stream's events cross the workers' link one by one
    (the mid-stream disconnect test needs the first event before the model has finished)."""
    root = tmp_path_factory.mktemp("generate")
    repo = build_decoupled_repository(root)
    args = ("--frontend-workers", "2") if request.param == "frontend-workers" else ()
    with QuiverServer(repo, args=args) as running:
        running.ready_file = root / "ready_state"  # type: ignore[attr-defined]
        yield running


def _connection(server: QuiverServer) -> http.client.HTTPConnection:
    parts = urlsplit(server.url if "://" in server.url else "http://" + server.url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)


def post(server: QuiverServer, path: str, body: Any) -> tuple[int, str, bytes]:
    conn = _connection(server)
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, response.getheader("Content-Type", ""), payload


def generate(server: QuiverServer, model: str, body: Any) -> tuple[int, dict[str, Any]]:
    status, content_type, payload = post(server, f"/v2/models/{model}/generate", body)
    assert content_type == "application/json"
    return status, json.loads(payload)


def events(payload: bytes) -> list[dict[str, Any]]:
    """The SSE body's events; every one must be ``data: <json>\\n\\n``."""
    chunks = payload.split(b"\n\n")
    assert chunks[-1] == b"", payload
    out = []
    for chunk in chunks[:-1]:
        assert chunk.startswith(b"data: "), chunk
        out.append(json.loads(chunk[6:]))
    return out


def stream(server: QuiverServer, model: str, body: Any) -> tuple[int, str, list[dict[str, Any]]]:
    status, content_type, payload = post(server, f"/v2/models/{model}/generate_stream", body)
    if content_type == "application/json":
        return status, content_type, [json.loads(payload)]
    return status, content_type, events(payload)


SSE = "text/event-stream; charset=utf-8"


def test_generate_maps_json_fields_to_inputs_and_outputs_to_fields(server: QuiverServer) -> None:
    status, body = generate(server, "mock_llm", {"PROMPT": "hello world", "STREAM": False, "id": "42"})
    assert status == 200
    assert body == {
        "id": "42", "model_name": "mock_llm", "model_version": "1", "TEXT": "hello world", "model_param": "mock",
    }
    status, body = generate(server, "mock_llm", {"PROMPT": "hi", "STREAM": False, "input_ids": [100, 200]})
    assert status == 200 and body["TEXT"] == "hi" and "id" not in body


def test_generate_stream_sends_one_event_per_response(server: QuiverServer) -> None:
    status, content_type, got = stream(
        server, "mock_llm", {"PROMPT": ["hello"], "STREAM": True, "parameters": {"REPETITION": 3}}
    )
    assert (status, content_type) == (200, SSE)
    assert [e["TEXT"] for e in got] == ["hello"] * 3


def test_the_example_token_streamer(server: QuiverServer) -> None:
    status, content_type, got = stream(
        server, "token_streamer", {"text_input": "a tiny streaming model", "max_tokens": 3}
    )
    assert (status, content_type) == (200, SSE)
    assert [e["text_output"] for e in got] == ["a ", "tiny ", "streaming"]
    assert [e["index"] for e in got] == [0, 1, 2]


def test_zero_and_many_responses(server: QuiverServer) -> None:
    status, content_type, got = stream(server, "mock_llm", {"PROMPT": "x", "STREAM": True, "REPETITION": 0})
    assert (status, content_type, got) == (200, SSE, [])
    for repetition in (0, 2):
        status, body = generate(server, "mock_llm", {"PROMPT": "x", "STREAM": True, "REPETITION": repetition})
        assert status == 500
        assert "generate expects model to produce exactly 1 response" in body["error"]
    status, body = generate(server, "mock_llm", {"PROMPT": "x", "STREAM": True})  # one, then a flag-only final
    assert status == 200 and body["TEXT"] == "x"


def test_an_error_response_in_the_stream(server: QuiverServer) -> None:
    status, _, got = stream(server, "mock_llm", {"PROMPT": "x", "STREAM": True, "REPETITION": 1, "FAIL_LAST": True})
    assert status == 200
    assert got[0]["TEXT"] == "x" and "An Error Occurred" in got[1]["error"] and len(got) == 2
    # The first response is the error: the stream's status is the error's.
    status, content_type, got = stream(
        server, "mock_llm", {"PROMPT": "x", "STREAM": True, "REPETITION": 0, "FAIL_LAST": True}
    )
    assert status == 500 and content_type == SSE and "An Error Occurred" in got[0]["error"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "missing required input(s) ['PROMPT','STREAM']"),
        ({"abc": 123}, "expected number of inputs between 2 and 3 but got 0 inputs"),
        ({"PROMPT": "hello"}, "missing required input(s) ['STREAM']"),
        ({"PROMPT": 123, "STREAM": False}, "attempt to access JSON non-string as string"),
        ({"PROMPT": "hello", "STREAM": "false"}, "attempt to access JSON non-boolean as boolean"),
        ({"PROMPT": "x", "STREAM": True, "input_ids": [1.5]}, "attempt to access JSON non-signed-integer"),
        ('{"PROMPT": "hello", "STREAM": false, "PROMPT": "again"}', "input 'PROMPT' already exists in request"),
        ({"PROMPT": "x", "STREAM": True, "PARAMS": {"a": 1}}, "parameter 'PARAMS' has invalid type"),
        ({"PROMPT": {"USER": "x"}, "STREAM": True}, "attempt to access JSON non-string as string"),
        ({"PROMPT": "x", "STREAM": True, "parameters": 1}, "Expected JSON object for keyword: 'parameters'"),
        (
            {"PROMPT": "x", "STREAM": True, "parameters": {"nested": {"twice": 1}}},
            "Converting keyword: 'parameters': parameter 'nested' has invalid type.",
        ),
        ({"PROMPT": "x", "STREAM": True, "id": 7}, "Unable to parse 'id'"),
        ('{"PROMPT": "x", ', "failed to parse the request JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_generate_requests_get_triton_messages(server: QuiverServer, body: Any, message: str) -> None:
    for path in ("generate", "generate_stream"):
        status, content_type, payload = post(server, f"/v2/models/mock_llm/{path}", body)
        assert (status, content_type) == (400, "application/json"), payload
        assert message in json.loads(payload)["error"]


def test_unknown_model_and_version(server: QuiverServer) -> None:
    status, body = generate(server, "no_such_model", {"PROMPT": "x"})
    assert status == 404 or status == 400
    assert "no_such_model" in body["error"]
    status, _, payload = post(server, "/v2/models/mock_llm/versions/7/generate", {"PROMPT": "x", "STREAM": False})
    assert status >= 400 and b"mock_llm" in payload


def test_generate_on_a_model_that_is_not_decoupled(server: QuiverServer) -> None:
    status, body = generate(server, "sender_plain", {"COUNT": 0, "mode": "sender"})
    assert status == 200 and body["TEXT"] == "sent" and body["via"] == "sender"
    status, content_type, got = stream(server, "sender_plain", {"COUNT": 0, "parameters": {"mode": "returned"}})
    assert (status, content_type) == (200, SSE) and [e["TEXT"] for e in got] == ["returned"]


def test_disconnecting_mid_stream_cancels_the_request(server: QuiverServer) -> None:
    conn = _connection(server)
    conn.request(
        "POST", "/v2/models/streamer/generate_stream", body=json.dumps({"COUNT": 1, "mode": "wait_cancel"}),
        headers={"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    assert response.status == 200
    first = response.readline()
    assert first.startswith(b"data: ") and json.loads(first[6:])["OUT"] == 0
    response.close()
    conn.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    seen = 0
    while time.monotonic() < deadline and not seen:
        _, _, got = stream(server, "streamer", {"COUNT": 1, "mode": "report"})
        seen = got[0]["OUT"]
        time.sleep(0.05)
    assert seen == 1, "the model never saw is_cancelled() after the client went away"
    live = _connection(server)
    live.request("GET", "/v2/health/live")
    with live.getresponse() as answer:
        assert answer.status == 200
    live.close()


def test_infer_refuses_a_decoupled_model_with_tritons_message(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    inp = httpclient.InferInput("COUNT", [1], "INT32")
    inp.set_data_from_numpy(__import__("numpy").array([1], dtype="int32"))
    with pytest.raises(InferenceServerException, match="HTTP end point doesn't support models with decoupled"):
        client.infer("streamer", [inp])


def test_an_ensemble_step_on_a_decoupled_model_is_refused_naming_it(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    inp = httpclient.InferInput("COUNT", [1], "INT32")
    inp.set_data_from_numpy(__import__("numpy").array([1], dtype="int32"))
    with pytest.raises(InferenceServerException, match="model 'streamer' uses the decoupled transaction policy"):
        client.infer("stream_ensemble", [inp])


def test_response_parameters_reach_http_clients(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    inp = httpclient.InferInput("COUNT", [1], "INT32")
    inp.set_data_from_numpy(__import__("numpy").array([0], dtype="int32"))
    result = client.infer("sender_plain", [inp], parameters={"mode": "returned"})
    assert result.get_response()["parameters"] == {"via": "sender"}


def test_user_is_ready_decides_model_readiness(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    ready_file = server.ready_file  # type: ignore[attr-defined]
    try:
        assert client.is_model_ready("ready_check")
        for state in ("false", "raise", "not a bool"):
            ready_file.write_text(state)
            assert not client.is_model_ready("ready_check"), state
            assert client.is_server_live()
        ready_file.write_text("slow")
        assert not client.is_model_ready("ready_check")  # past Triton's 5 s timeout
        ready_file.write_text("true")
        deadline = time.monotonic() + 10
        while not client.is_model_ready("ready_check") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.is_model_ready("ready_check")
    finally:
        ready_file.write_text("true")
