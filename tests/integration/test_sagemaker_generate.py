"""SAGEMAKER_TRITON_INFERENCE_TYPE: /invocations as KServe v2 inference (infer), or as the
generate extension (generate: one JSON answer; generate_stream: Server-Sent Events); an
invalid value fails at start."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from support.decoupled_models import build_decoupled_repository
from support.server import QuiverServer, run_quiver


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_decoupled_repository(tmp_path_factory.mktemp("sagemaker_generate"))


def invoke(server: QuiverServer, body: object, path: str = "/invocations") -> tuple[int, str, bytes]:
    parts = urlsplit(server.sagemaker_url if "://" in server.sagemaker_url else "http://" + server.sagemaker_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, response.getheader("Content-Type", ""), payload


@pytest.mark.parametrize("args", [(), ("--frontend-workers", "2")], ids=["one-process", "frontend-workers"])
def test_generate_stream_invocations(repo: Path, args: tuple[str, ...]) -> None:
    env = {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "token_streamer", "SAGEMAKER_TRITON_INFERENCE_TYPE": "generate_stream"}
    with QuiverServer(repo, args=args, env=env) as server:
        status, content_type, payload = invoke(server, {"text_input": "one two three"})
        assert (status, content_type) == (200, "text/event-stream; charset=utf-8")
        events = [json.loads(chunk[6:]) for chunk in payload.split(b"\n\n") if chunk]
        assert [e["text_output"] for e in events] == ["one ", "two ", "three"]
        status, content_type, payload = invoke(server, {"max_tokens": 2})
        assert status == 400 and "missing required input(s) ['text_input']" in json.loads(payload)["error"]


def test_generate_invocations_and_multi_model_target(repo: Path) -> None:
    env = {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "mock_llm", "SAGEMAKER_TRITON_INFERENCE_TYPE": "generate"}
    with QuiverServer(repo, env=env) as server:
        status, content_type, payload = invoke(server, {"PROMPT": "hello", "STREAM": False, "id": "7"})
        assert (status, content_type) == (200, "application/json")
        assert json.loads(payload) == {
            "id": "7", "model_name": "mock_llm", "model_version": "1", "TEXT": "hello", "model_param": "mock",
        }
        status, _, payload = invoke(server, {"PROMPT": "hello", "STREAM": True, "REPETITION": 2})
        assert status == 500 and b"generate expects model to produce exactly 1 response" in payload


def test_infer_is_the_default(repo: Path) -> None:
    with QuiverServer(repo, env={"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "streamer"}) as server:
        body = {"inputs": [{"name": "COUNT", "datatype": "INT32", "shape": [1], "data": [1]}]}
        status, _, payload = invoke(server, body)
        assert status >= 400  # a decoupled model needs a generate type there
        assert b"HTTP end point doesn't support models with decoupled transaction policy" in payload


def test_an_invalid_inference_type_fails_at_start(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAGEMAKER_TRITON_INFERENCE_TYPE", "stream")
    refused = run_quiver("serve", "--model-repository", str(repo), "--allow-sagemaker", "--sagemaker-port", "0")
    assert refused.returncode != 0
    assert "Invalid SAGEMAKER_TRITON_INFERENCE_TYPE 'stream': must be one of: infer, generate, generate_stream" in (
        refused.stderr + refused.stdout
    )
