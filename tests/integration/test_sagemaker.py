"""The SageMaker container contract on a real server: /ping, /invocations, the multi-model
/models API, binary+json bodies, and the four hosting modes (single model, single ensemble,
multi-model, multi-model with ensembles)."""

from __future__ import annotations

import http.client
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from test_ensemble import build

from support.models import add_constant_onnx, write_onnx
from support.server import QuiverServer, run_quiver

BINARY_JSON = "application/vnd.sagemaker-triton.binary+json;json-header-size="
TARGET = "X-Amzn-SageMaker-Target-Model"

ADD = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""


class Reply:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


def call(
    base: str, method: str, path: str, body: bytes | dict[str, Any] | None = None, headers: dict[str, str] | None = None
) -> Reply:
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        send_headers = dict(headers or {})
        if isinstance(body, dict):
            send_headers.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=data, headers=send_headers)
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


def json_request(x: np.ndarray, name: str = "IN") -> dict[str, Any]:
    return {"inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()}]}


def outputs(reply: Reply) -> dict[str, np.ndarray]:
    assert reply.status == 200, reply.body
    return {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in reply.json()["outputs"]}


def invoke(base: str, path: str, x: np.ndarray, name: str = "IN", **headers: str) -> Reply:
    return call(base, "POST", path, json_request(x, name), {k.replace("_", "-"): v for k, v in headers.items()})


@pytest.fixture(scope="module")
def ensemble_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """add_one, add_ten, double and pipeline (an ensemble of the three): test_ensemble's."""
    repo = tmp_path_factory.mktemp("sm_ensemble")
    build(repo)
    shutil.rmtree(repo / "broken_pipeline")
    return repo


@pytest.fixture(scope="module")
def single_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("sm_single")
    write_onnx(repo, "add_two", add_constant_onnx(2.0), ADD.format(name="add_two"))
    return repo


@pytest.fixture(scope="module", params=["one-process", "frontend-workers"])
def mme(request: pytest.FixtureRequest, ensemble_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    """Multi-model mode, explicit control: nothing loaded until POST /models; served by the
    server process, then by frontend worker processes."""
    other = tmp_path_factory.mktemp("sm_other")
    write_onnx(other, "add_five", add_constant_onnx(5.0), ADD.format(name="add_five"))
    args: tuple[str, ...] = ("--model-control-mode=explicit",)
    if request.param == "frontend-workers":
        args += ("--frontend-workers", "2")
    with QuiverServer(ensemble_repo, other, args=args, env={"SAGEMAKER_MULTI_MODEL": "true"}) as server:
        yield server


# -- multi-model mode ------------------------------------------------------------------


def test_ping_and_routes_that_do_not_exist(mme: QuiverServer) -> None:
    assert call(mme.sagemaker_url, "GET", "/ping").status == 200
    missing = call(mme.sagemaker_url, "GET", "/nowhere")
    assert missing.status == 404 and "no route" in missing.json()["error"]
    assert call(mme.sagemaker_url, "PUT", "/models").status == 405
    assert call(mme.sagemaker_url, "GET", "/invocations").status == 405


def test_load_invoke_get_unload_one_model(mme: QuiverServer, ensemble_repo: Path) -> None:
    base = mme.sagemaker_url
    url = str(ensemble_repo / "add_ten")
    load = call(base, "POST", "/models", {"model_name": "hash-ten", "url": url}, {TARGET: "add_ten_v0.tar.gz"})
    assert load.status == 200, load.body
    again = call(base, "POST", "/models", {"model_name": "hash-ten", "url": url})
    assert again.status == 409 and "already loaded" in again.json()["error"]
    assert call(base, "GET", "/models/hash-ten").json() == {"modelName": "hash-ten", "modelUrl": url}

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    # SageMaker's own route, the TargetModel of the load, and the SageMaker name all reach it.
    np.testing.assert_array_equal(outputs(invoke(base, "/models/hash-ten/invoke", x, "INPUT0"))["OUTPUT0"], x + 10)
    for target in ("add_ten_v0.tar.gz", "hash-ten", "add_ten"):
        reply = invoke(base, "/invocations", x, "INPUT0", **{TARGET: target})
        np.testing.assert_array_equal(outputs(reply)["OUTPUT0"], x + 10)

    assert call(base, "DELETE", "/models/hash-ten").status == 200
    assert call(base, "GET", "/models/hash-ten").status == 404
    assert call(base, "DELETE", "/models/hash-ten").status == 404
    gone = invoke(base, "/invocations", x, "INPUT0", **{TARGET: "add_ten"})
    assert gone.status == 503, gone.body  # unloaded: UNAVAILABLE, as on v2


def test_target_model_header_is_required_and_checked(mme: QuiverServer) -> None:
    x = np.ones((1, 4), np.float32)
    missing = invoke(mme.sagemaker_url, "/invocations", x)
    assert missing.status == 400 and "X-Amzn-SageMaker-Target-Model" in missing.json()["error"]
    unknown = invoke(mme.sagemaker_url, "/invocations", x, **{TARGET: "ghost.tar.gz"})
    assert unknown.status == 404 and "ghost.tar.gz" in unknown.json()["error"]
    assert invoke(mme.sagemaker_url, "/models/ghost/invoke", x).status == 404


def test_bad_load_requests(mme: QuiverServer, ensemble_repo: Path, tmp_path: Path) -> None:
    base = mme.sagemaker_url
    empty = tmp_path / "empty"
    empty.mkdir()
    cases: list[tuple[bytes | dict[str, Any], int, str]] = [
        (b"{not json", 400, "malformed JSON"),
        (b"[1]", 400, "JSON object"),
        ({"url": str(ensemble_repo / "add_one")}, 400, "model_name"),
        ({"model_name": "x"}, 400, "url"),
        ({"model_name": "x", "url": str(ensemble_repo / "nothing_here")}, 404, "does not exist"),
        ({"model_name": "x", "url": "/proc/self"}, 400, "/proc"),
        ({"model_name": "x", "url": str(empty)}, 400, "holds no model"),
        ({"model_name": "x", "url": "ftp://host/model.tar.gz"}, 501, "only s3:// URLs and local paths"),
    ]
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    cases.append(({"model_name": "x", "url": str(a_file)}, 400, "is not a folder"))
    for body, status, text in cases:
        reply = call(base, "POST", "/models", body)
        assert reply.status == status, (body, reply.body)
        assert text in reply.json()["error"], (body, reply.body)
    assert call(base, "GET", "/models/x").status == 404


def test_multi_model_with_ensembles(mme: QuiverServer, ensemble_repo: Path) -> None:
    """An archive-like repository whose ensemble is the model: the url names the repository,
    the ensemble is picked, its steps load with it and unload with it."""
    base = mme.sagemaker_url
    triton = httpclient.InferenceServerClient(mme.url)
    assert call(base, "POST", "/models", {"model_name": "ens", "url": str(ensemble_repo)}).status == 200
    assert call(base, "POST", "/models", {"model_name": "ten", "url": str(ensemble_repo / "add_ten")}).status == 200
    x = np.array([[1, 2, 3, 4]], np.float32)
    result = outputs(invoke(base, "/invocations", x, **{TARGET: "ens"}))
    np.testing.assert_array_equal(result["DOUBLED"], (x + 1) * 2)
    np.testing.assert_array_equal(result["PLUS_TEN"], x + 10)
    listed = {m["modelName"]: m["modelUrl"] for m in call(base, "GET", "/models").json()["models"]}
    assert listed == {"ens": str(ensemble_repo), "ten": str(ensemble_repo / "add_ten")}

    assert call(base, "DELETE", "/models/ens").status == 200
    # The ensemble and the steps only it used are gone; add_ten, loaded as 'ten', stays.
    for name in ("pipeline", "add_one", "double"):
        assert not triton.is_model_ready(name), name
    assert triton.is_model_ready("add_ten")
    assert call(base, "DELETE", "/models/ten").status == 200
    assert not triton.is_model_ready("add_ten")


def test_list_models_pages(mme: QuiverServer, ensemble_repo: Path) -> None:
    base = mme.sagemaker_url
    names = [f"page-{i}" for i in range(3)]
    folders = ["add_one", "add_ten", "double"]
    for name, folder in zip(names, folders, strict=True):
        assert call(base, "POST", "/models", {"model_name": name, "url": str(ensemble_repo / folder)}).status == 200
    try:
        seen: list[str] = []
        path = "/models?max_results=2"
        pages = 0
        while True:
            page = call(base, "GET", path).json()
            pages += 1
            assert len(page["models"]) <= 2
            seen += [m["modelName"] for m in page["models"]]
            token = page.get("nextPageToken")
            if token is None:
                break
            path = f"/models?max_results=2&next_page_token={token}"
        assert seen == names and pages == 2
        assert call(base, "GET", "/models?max_results=0").status == 400
        assert call(base, "GET", "/models?next_page_token=%25%25%25").status == 400
    finally:
        for name in names:
            call(base, "DELETE", f"/models/{name}")


def test_binary_json_both_ways_matches_json(mme: QuiverServer, ensemble_repo: Path) -> None:
    base = mme.sagemaker_url
    assert call(base, "POST", "/models", {"model_name": "bin", "url": str(ensemble_repo / "pipeline")}).status == 200
    try:
        x = np.random.default_rng(0).random((3, 4), dtype=np.float32)
        expected = outputs(invoke(base, "/invocations", x, **{TARGET: "bin"}))

        # By hand: the JSON header, then the raw tensor; its length in the content type.
        header = json.dumps({
            "inputs": [{"name": "IN", "datatype": "FP32", "shape": [3, 4], "parameters": {"binary_data_size": x.nbytes}}],
            "outputs": [{"name": "DOUBLED", "parameters": {"binary_data": True}}, {"name": "PLUS_TEN"}],
        }).encode()
        reply = call(
            base, "POST", "/invocations", header + x.tobytes(),
            {"Content-Type": BINARY_JSON + str(len(header)), TARGET: "bin"},
        )
        assert reply.status == 200, reply.body
        assert reply.headers["content-type"].startswith(BINARY_JSON)
        size = int(reply.headers["content-type"][len(BINARY_JSON):])
        meta = json.loads(reply.body[:size])
        doubled, plus_ten = meta["outputs"]
        assert doubled["parameters"]["binary_data_size"] == 12 * 4
        got = np.frombuffer(reply.body[size:], np.float32).reshape(3, 4)
        np.testing.assert_array_equal(got, expected["DOUBLED"])
        np.testing.assert_array_equal(np.array(plus_ten["data"], np.float32).reshape(3, 4), expected["PLUS_TEN"])

        # As the seed documents do it: tritonclient builds the body and parses the answer.
        inp = httpclient.InferInput("IN", [3, 4], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        wanted = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("DOUBLED", "PLUS_TEN")]
        body, json_size = httpclient.InferenceServerClient.generate_request_body([inp], outputs=wanted)
        reply = call(base, "POST", "/models/bin/invoke", body, {"Content-Type": BINARY_JSON + str(json_size)})
        assert reply.status == 200, reply.body
        size = int(reply.headers["content-type"][len(BINARY_JSON):])
        result = httpclient.InferenceServerClient.parse_response_body(reply.body, header_length=size)
        np.testing.assert_array_equal(result.as_numpy("DOUBLED"), expected["DOUBLED"])
        np.testing.assert_array_equal(result.as_numpy("PLUS_TEN"), expected["PLUS_TEN"])

        # JSON in, JSON out: plain application/json.
        plain = invoke(base, "/invocations", x, **{TARGET: "bin"})
        assert plain.headers["content-type"] == "application/json"

        bad = call(base, "POST", "/invocations", header + x.tobytes(), {"Content-Type": BINARY_JSON + "99999", TARGET: "bin"})
        assert bad.status == 400 and "json-header-size" in bad.json()["error"]
        bad = call(base, "POST", "/invocations", header + x.tobytes(), {"Content-Type": BINARY_JSON + "x", TARGET: "bin"})
        assert bad.status == 400
    finally:
        call(base, "DELETE", "/models/bin")


def test_kserve_listeners_still_serve_beside_it(mme: QuiverServer, ensemble_repo: Path) -> None:
    base = mme.sagemaker_url
    assert call(base, "POST", "/models", {"model_name": "v2", "url": str(ensemble_repo / "add_one")}).status == 200
    try:
        x = np.ones((1, 4), np.float32)
        h = httpclient.InferenceServerClient(mme.url)
        assert h.is_server_ready()
        hin = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        hin.set_data_from_numpy(x)
        np.testing.assert_array_equal(h.infer("add_one", [hin]).as_numpy("OUTPUT0"), x + 1)
        g = grpcclient.InferenceServerClient(mme.grpc_url)
        assert g.is_server_ready()
        gin = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        gin.set_data_from_numpy(x)
        np.testing.assert_array_equal(g.infer("add_one", [gin]).as_numpy("OUTPUT0"), x + 1)
        # A model loaded through the v2 repository API is listed under its own name.
        h.load_model("add_five")
        listed = {m["modelName"]: m["modelUrl"] for m in call(base, "GET", "/models").json()["models"]}
        assert listed["v2"] == str(ensemble_repo / "add_one")
        assert listed["add_five"].endswith("/add_five")
        assert call(base, "DELETE", "/models/add_five").status == 200
        assert not h.is_model_ready("add_five")
    finally:
        call(base, "DELETE", "/models/v2")


# -- single-model mode ----------------------------------------------------------------


def test_single_ensemble_by_default_model_name(ensemble_repo: Path) -> None:
    env = {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "pipeline"}
    with QuiverServer(ensemble_repo, env=env) as server:
        assert call(server.sagemaker_url, "GET", "/ping").status == 200
        x = np.array([[1, 2, 3, 4]], np.float32)
        result = outputs(invoke(server.sagemaker_url, "/invocations", x))
        np.testing.assert_array_equal(result["DOUBLED"], (x + 1) * 2)
        bad = invoke(server.sagemaker_url, "/invocations", x, name="NOPE")
        assert bad.status == 400 and "NOPE" in bad.json()["error"]


def test_single_model_falls_back_to_the_only_model(single_repo: Path, ensemble_repo: Path) -> None:
    x = np.zeros((2, 4), np.float32)
    # SageMaker alone, as Triton's SageMaker container runs it (no v2 listeners).
    args = ("--allow-sagemaker", "--allow-http=false", "--allow-grpc=false")
    with QuiverServer(single_repo, args=args) as server:
        np.testing.assert_array_equal(outputs(invoke(server.sagemaker_url, "/invocations", x, "INPUT0"))["OUTPUT0"], x + 2)
        # The TargetModel header means nothing in single-model mode.
        reply = invoke(server.sagemaker_url, "/invocations", x, "INPUT0", **{TARGET: "whatever"})
        np.testing.assert_array_equal(outputs(reply)["OUTPUT0"], x + 2)
    # An ensemble and its steps: the ensemble is the only model that is not a step.
    with QuiverServer(ensemble_repo, sagemaker=True) as server:
        result = outputs(invoke(server.sagemaker_url, "/invocations", x))
        np.testing.assert_array_equal(result["PLUS_TEN"], x + 10)
    # Two unrelated models: no default.
    with QuiverServer(ensemble_repo, single_repo, sagemaker=True) as server:
        reply = invoke(server.sagemaker_url, "/invocations", x)
        assert reply.status == 404 and "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME" in reply.json()["error"]


def test_ping_modes(single_repo: Path) -> None:
    env = {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "ghost"}
    with QuiverServer(single_repo, env=env) as server:
        assert call(server.sagemaker_url, "GET", "/ping").status == 503  # ready: the model is not
        assert invoke(server.sagemaker_url, "/invocations", np.ones((1, 4), np.float32)).status == 404
    with QuiverServer(single_repo, env={**env, "SAGEMAKER_TRITON_PING_MODE": "live"}) as server:
        assert call(server.sagemaker_url, "GET", "/ping").status == 200


def test_sagemaker_is_off_unless_asked(single_repo: Path) -> None:
    with QuiverServer(single_repo) as server:
        assert "SageMaker" not in server.log
        assert server.sagemaker_port == 0


def test_safe_port_range(single_repo: Path) -> None:
    refused = run_quiver(
        "serve", "--model-repository", str(single_repo), "--allow-sagemaker",
        "--sagemaker-port", "7000", "--sagemaker-safe-port-range", "20000-20999",
    )
    assert refused.returncode != 0
    assert "SageMaker port 7000 is outside the safe port range 20000-20999" in refused.stderr
    bad = run_quiver("serve", "--model-repository", str(single_repo), "--allow-sagemaker", "--sagemaker-safe-port-range", "9-x")
    assert bad.returncode == 2 and "LOW-HIGH" in bad.stderr
    # Port 0 with a range: a free port inside it.
    with QuiverServer(single_repo, env={"SAGEMAKER_SAFE_PORT_RANGE": "23000-23999", "SAGEMAKER_TRITON_PING_MODE": "live"}) as server:
        assert 23000 <= server.sagemaker_port <= 23999
        assert call(server.sagemaker_url, "GET", "/ping").status == 200



def test_limits_are_client_errors_on_both_routes(mme: QuiverServer, ensemble_repo: Path) -> None:
    """Shapes past an array and JSON past 100 levels, as JSON and as binary+json, on
    /invocations and /models/{name}/invoke: 400 naming the field, then a right answer."""
    base = mme.sagemaker_url
    assert call(base, "POST", "/models", {"model_name": "limits", "url": str(ensemble_repo / "add_ten")}).status == 200
    huge = 1 << 62
    deep = "[" * 1000 + "1" + "]" * 1000
    try:
        bodies: list[tuple[bytes, dict[str, str], str]] = []
        text = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": "MARK"}]})
        bodies.append((text.replace('"MARK"', deep).encode(), {"Content-Type": "application/json"}, "input 'INPUT0': 'data': JSON nesting depth exceeds maximum allowed limit (100)"))
        text = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}], "parameters": {"p": "MARK"}})
        bodies.append((text.replace('"MARK"', deep).encode(), {"Content-Type": "application/json"}, "inference request: 'parameters': JSON nesting depth exceeds"))
        plain = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [0, huge], "data": []}]}).encode()
        bodies.append((plain, {"Content-Type": "application/json"}, f"input 'INPUT0': shape [0, {huge}] is too large"))
        plain = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1] * 65, "data": [1]}]}).encode()
        bodies.append((plain, {"Content-Type": "application/json"}, "'shape' has 65 dimensions"))
        header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [huge, 0], "parameters": {"binary_data_size": 0}}]}).encode()
        bodies.append((header, {"Content-Type": BINARY_JSON + str(len(header))}, f"input 'INPUT0': shape [{huge}, 0] is too large"))
        header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1 << 40], "parameters": {"binary_data_size": 4}}]}).encode()
        bodies.append((header + bytes(4), {"Content-Type": BINARY_JSON + str(len(header))}, "need at least"))
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        for body, headers, message in bodies:
            for path, extra in (("/invocations", {TARGET: "limits"}), ("/models/limits/invoke", {})):
                reply = call(base, "POST", path, body, headers | extra)
                assert reply.status == 400, (path, reply.body)
                assert message in reply.json()["error"], (path, reply.body)
                np.testing.assert_array_equal(outputs(invoke(base, path, x, "INPUT0", **extra))["OUTPUT0"], x + 10)
        deep_load = json.dumps({"model_name": "MARK", "url": "x"}).replace('"MARK"', deep).encode()
        reply = call(base, "POST", "/models", deep_load, {"Content-Type": "application/json"})
        assert reply.status == 400 and "load request: 'model_name': JSON nesting depth exceeds" in reply.json()["error"]
    finally:
        call(base, "DELETE", "/models/limits")
