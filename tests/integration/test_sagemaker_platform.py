"""The SageMaker platform's multi-model flow against the container entrypoint, as on a real
endpoint: Quiver starts through ``quiver sagemaker-serve`` with SAGEMAKER_MULTI_MODEL=true
(explicit model control, an empty repository, no v2 listener), the test extracts each
TargetModel archive to ``<models>/<hash>/model`` as the platform does, then drives
``POST /models``, invoke (JSON and binary+json), ``GET /models`` (paged), ``GET
/models/<hash>``, ``DELETE /models/<hash>``, and the 507 -> unload -> retry cycle."""

from __future__ import annotations

import hashlib
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from test_sagemaker import BINARY_JSON, TARGET, Reply, call, invoke, outputs

from support.archives import listing, pipeline_archive, single_archive
from support.models import write_python
from support.sagemaker import EntrypointServer, platform_extract

WEIGHT_MB = 16


def model_hash(target: str) -> str:
    """SageMaker's model_name: a hash of the TargetModel."""
    return hashlib.sha256(target.encode()).hexdigest()[:32]


class Platform:
    """The platform's side: its models root, and the container it calls."""

    def __init__(self, server: EntrypointServer, models: Path) -> None:
        self.server = server
        self.models = models

    @property
    def base(self) -> str:
        return self.server.sagemaker_url

    def load(self, target: str, archive: bytes) -> tuple[str, Reply]:
        name = model_hash(target)
        folder = self.models / name / "model"
        if not folder.exists():
            platform_extract(archive, self.models, name)
        reply = call(self.base, "POST", "/models", {"model_name": name, "url": str(folder)}, {TARGET: target})
        return name, reply

    def unload(self, name: str) -> Reply:
        reply = call(self.base, "DELETE", f"/models/{name}")
        if reply.status == 200:
            shutil.rmtree(self.models / name)  # the platform deletes what it extracted
        return reply


def binary_invoke(base: str, path: str, x: np.ndarray, name: str) -> Reply:
    """A binary+json request asking for a binary output (SageMaker's content type carries
    the JSON length: no custom headers)."""
    request, json_size = httpclient.InferenceServerClient.generate_request_body(
        [_binary_input(name, x)],
        outputs=[httpclient.InferRequestedOutput("OUT" if name == "IN" else "OUTPUT0", binary_data=True)],
    )
    assert json_size is not None
    return call(base, "POST", path, request, {"Content-Type": BINARY_JSON + str(json_size)})


def _binary_input(name: str, x: np.ndarray) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    return tensor


def binary_outputs(reply: Reply) -> dict[str, np.ndarray]:
    assert reply.status == 200, reply.body
    content_type = reply.headers["content-type"]
    assert content_type.startswith(BINARY_JSON), content_type
    size = int(content_type[len(BINARY_JSON) :])
    result = httpclient.InferenceServerClient.parse_response_body(reply.body, header_length=size)
    return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("sm_platform")
    models = root / "models"
    models.mkdir()
    env = {"SAGEMAKER_MULTI_MODEL": "true"}
    with EntrypointServer(root / "unused_model_root", root / "sagemaker", env=env) as server:
        yield Platform(server, models)


X = np.arange(8, dtype=np.float32).reshape(2, 4)


def test_entrypoint_starts_as_tritons_sagemaker_image(platform: Platform) -> None:
    log = platform.server.log
    assert 'SageMaker MME mode. Using ping mode: "live"' in log
    assert "--allow-http=false" in log and "--model-control-mode=explicit" in log
    assert "started HTTP service" not in log and "started GRPC service" not in log
    assert "started Metrics service" not in log
    assert (platform.server.multi_model_repository).is_dir()  # created, empty
    assert call(platform.base, "GET", "/ping").status == 200  # live: nothing loaded yet
    assert call(platform.base, "GET", "/models").json() == {"models": []}


def test_single_model_archive_json_and_binary(platform: Platform) -> None:
    target = "add_three.tar.gz"
    name, load = platform.load(target, single_archive(3.0, folder="add_three", name="add_three"))
    assert load.status == 200, load.body
    url = str(platform.models / name / "model")
    assert call(platform.base, "GET", f"/models/{name}").json() == {"modelName": name, "modelUrl": url}
    again = call(platform.base, "POST", "/models", {"model_name": name, "url": url}, {TARGET: target})
    assert again.status == 409 and name in again.json()["error"]

    np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{name}/invoke", X, "INPUT0"))["OUTPUT0"], X + 3)
    via_target = invoke(platform.base, "/invocations", X, "INPUT0", **{TARGET: target})
    np.testing.assert_array_equal(outputs(via_target)["OUTPUT0"], X + 3)
    binary = binary_outputs(binary_invoke(platform.base, f"/models/{name}/invoke", X, "INPUT0"))
    np.testing.assert_array_equal(binary["OUTPUT0"], X + 3)

    assert platform.unload(name).status == 200
    assert call(platform.base, "GET", f"/models/{name}").status == 404
    assert call(platform.base, "DELETE", f"/models/{name}").status == 404
    assert invoke(platform.base, f"/models/{name}/invoke", X, "INPUT0").status == 503  # as on v2


def test_two_ensembles_with_a_preprocess_each_keep_their_own(platform: Platform) -> None:
    """Each folder is its own namespace: both ensembles' ``preprocess`` load side by side and
    each ensemble runs its own; unloading one leaves the other whole."""
    first, a = platform.load("pipe_a.tar.gz", pipeline_archive(1.0))
    second, b = platform.load("pipe_b.tar.gz", pipeline_archive(2.0))
    assert a.status == 200 and b.status == 200, (a.body, b.body)
    np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{first}/invoke", X))["OUT"], X + 101)
    np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{second}/invoke", X))["OUT"], X + 102)
    binary = binary_outputs(binary_invoke(platform.base, f"/models/{second}/invoke", X, "IN"))
    np.testing.assert_array_equal(binary["OUT"], X + 102)
    listed = {m["modelName"] for m in call(platform.base, "GET", "/models").json()["models"]}
    assert {first, second} <= listed  # the ensembles, not their steps
    assert not any("preprocess" in m or "::" in m for m in listed)

    assert platform.unload(first).status == 200
    np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{second}/invoke", X))["OUT"], X + 102)
    assert platform.unload(second).status == 200
    assert call(platform.base, "GET", "/models").json() == {"models": []}


def test_list_pages_as_the_platform_reads_them(platform: Platform) -> None:
    names = []
    for i in range(5):
        name, reply = platform.load(f"page{i}.tar.gz", single_archive(float(i), folder=f"p{i}", name=f"p{i}"))
        assert reply.status == 200, reply.body
        names.append(name)
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        query = "?max_results=2" + (f"&next_page_token={token}" if token else "")
        page = call(platform.base, "GET", "/models" + query).json()
        pages += 1
        assert len(page["models"]) <= 2
        for entry in page["models"]:
            assert entry["modelUrl"] == str(platform.models / entry["modelName"] / "model")
        seen += [m["modelName"] for m in page["models"]]
        token = page.get("nextPageToken", "")
        if not token:
            break
    assert sorted(seen) == sorted(names) and pages == 3
    assert call(platform.base, "GET", "/models?max_results=0").status == 400
    assert call(platform.base, "GET", "/models?next_page_token=@@").status == 400
    for name in names:
        assert platform.unload(name).status == 200


def test_bad_loads_answer_and_the_rest_keeps_serving(platform: Platform, tmp_path: Path) -> None:
    kept, reply = platform.load("kept.tar.gz", single_archive(7.0, folder="kept", name="kept"))
    assert reply.status == 200
    a_file = tmp_path / "model.onnx"
    a_file.write_bytes(b"not a folder")
    empty = tmp_path / "empty" / "model"
    empty.mkdir(parents=True)
    broken = platform_extract(single_archive(1.0, folder="broken", name="broken"), tmp_path, "broken")
    (broken / "broken" / "config.pbtxt").write_text("name: 'broken' backend: onnxruntime input [ {")
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"model_name": "m"}, 400, "url"),
        ({"model_name": "m", "url": str(tmp_path / "nowhere" / "model")}, 404, "does not exist"),
        ({"model_name": "m", "url": str(a_file)}, 400, "is not a folder"),
        ({"model_name": "m", "url": str(empty)}, 400, "holds no model"),
        ({"model_name": "m", "url": str(broken)}, 400, "broken"),
        ({"model_name": kept, "url": str(platform.models / kept / "model")}, 409, "already loaded"),
        ({"model_name": "../escape", "url": str(broken)}, 400, "not a valid model name"),
    ]
    for body, status, text in cases:
        answer = call(platform.base, "POST", "/models", body)
        assert answer.status == status, (body, answer.body)
        assert text in answer.json()["error"], (body, answer.body)
    assert call(platform.base, "GET", "/models/m").status == 404
    np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{kept}/invoke", X, "INPUT0"))["OUTPUT0"], X + 7)
    assert platform.unload(kept).status == 200


def test_memory_budget_answers_507_then_the_platform_unloads_and_retries(tmp_path: Path) -> None:
    """With a memory limit, a load that does not fit is 507 and unloads nothing (the platform
    chooses); after the platform unloads a model, the same load succeeds."""
    models = tmp_path / "models"
    env = {
        "SAGEMAKER_MULTI_MODEL": "true",
        "SAGEMAKER_TRITON_ADDITIONAL_ARGS": f"--model-memory-limit={2 * WEIGHT_MB + 20}M",
    }
    with EntrypointServer(tmp_path / "unused", tmp_path / "sagemaker", env=env) as server:
        platform = Platform(server, models)
        loaded: list[str] = []
        refused = None
        for i in range(6):
            archive = single_archive(float(i), folder=f"heavy{i}", name=f"heavy{i}", weight_mb=WEIGHT_MB)
            name, reply = platform.load(f"heavy{i}.tar.gz", archive)
            if reply.status == 507:
                refused = (i, name, archive)
                assert "memory" in reply.json()["error"]
                break
            assert reply.status == 200, reply.body
            loaded.append(name)
        assert refused is not None and len(loaded) >= 1, server.log
        # Nothing was unloaded for it: every model loaded before still answers.
        for j, name in enumerate(loaded):
            np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{name}/invoke", X, "INPUT0"))["OUTPUT0"], X + j)
        assert "evicted to make room" not in server.log
        i, name, archive = refused
        assert call(platform.base, "GET", f"/models/{name}").status == 404
        assert platform.unload(loaded[0]).status == 200
        _, retry = platform.load(f"heavy{i}.tar.gz", archive)
        assert retry.status == 200, retry.body
        np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{name}/invoke", X, "INPUT0"))["OUTPUT0"], X + i)


def test_namespacing_disabled_refuses_a_second_preprocess(tmp_path: Path) -> None:
    # Triton's script passes the value through as --model-namespacing: false turns it off.
    env = {"SAGEMAKER_MULTI_MODEL": "true", "SAGEMAKER_TRITON_DISABLE_MODEL_NAMESPACING": "false"}
    with EntrypointServer(tmp_path / "unused", tmp_path / "sagemaker", env=env) as server:
        platform = Platform(server, tmp_path / "models")
        first, a = platform.load("pipe_a.tar.gz", pipeline_archive(1.0))
        assert a.status == 200, a.body
        np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{first}/invoke", X))["OUT"], X + 101)
        second, b = platform.load("pipe_b.tar.gz", pipeline_archive(2.0))
        assert b.status == 409, b.body
        assert "preprocess" in b.json()["error"] and "namespacing" in b.json()["error"]
        # The refused load left the first ensemble whole; once it is gone, the second loads.
        np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{first}/invoke", X))["OUT"], X + 101)
        assert platform.unload(first).status == 200
        _, again = platform.load("pipe_b.tar.gz", pipeline_archive(2.0))
        assert again.status == 200, again.body
        np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{second}/invoke", X))["OUT"], X + 102)


def test_v2_listener_beside_the_platform_flow_when_asked(tmp_path: Path) -> None:
    """SAGEMAKER_TRITON_ALLOW_GRPC / _ALLOW_METRICS turn those listeners on, on their ports."""
    env = {
        "SAGEMAKER_MULTI_MODEL": "true",
        "SAGEMAKER_TRITON_ALLOW_GRPC": "true",
        "SAGEMAKER_TRITON_GRPC_PORT": "0",
        "SAGEMAKER_TRITON_ALLOW_METRICS": "true",
        "SAGEMAKER_TRITON_METRICS_PORT": "0",
        "SAGEMAKER_TRITON_THREAD_COUNT": "3",
    }
    with EntrypointServer(tmp_path / "unused", tmp_path / "sagemaker", env=env) as server:
        assert "started GRPC service at 0.0.0.0" in server.log
        assert "3 codec threads" in server.log
        platform = Platform(server, tmp_path / "models")
        name, reply = platform.load("m.tar.gz", single_archive(2.0, folder="m", name="m"))
        assert reply.status == 200
        outputs(invoke(platform.base, f"/models/{name}/invoke", X, "INPUT0"))
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            text = response.read().decode()
        assert f'nv_inference_request_success{{model="{name}",version="1"}} 1' in text
        assert "quiver_loaded_model_count" in text  # the multi-model metrics
        client = grpcclient.InferenceServerClient(server.grpc_url)
        assert client.is_model_ready(name)
        assert client.get_server_metadata(as_json=True)["name"] == "quiver"


def test_nothing_is_written_outside_the_cache_and_no_link_is_followed(tmp_path: Path) -> None:
    """The platform's folders are read, never written; what is loaded is a copy in the cache;
    a link in a platform folder that leaves it is refused (400), not followed."""
    cache = tmp_path / "cache"
    secret = tmp_path / "secret.onnx"
    secret.write_bytes(b"not yours")
    env = {"SAGEMAKER_MULTI_MODEL": "true", "QUIVER_CACHE_DIR": str(cache)}
    with EntrypointServer(tmp_path / "unused", tmp_path / "sagemaker", env=env) as server:
        platform = Platform(server, tmp_path / "models")
        name = model_hash("pipe.tar.gz")
        platform_extract(pipeline_archive(3.0), platform.models, name)
        before = listing(platform.models, skip=cache)
        _, reply = platform.load("pipe.tar.gz", b"")
        assert reply.status == 200, reply.body
        np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{name}/invoke", X))["OUT"], X + 103)
        assert listing(platform.models, skip=cache) == before  # read only
        assert list((tmp_path / "sagemaker").iterdir()) == []  # the empty repository stays empty
        assert any(cache.rglob("config.pbtxt"))  # what is served is the cache's copy
        assert call(platform.base, "DELETE", f"/models/{name}").status == 200

        linked = model_hash("linked.tar.gz")
        folder = platform_extract(single_archive(1.0, folder="m", name="m"), platform.models, linked)
        (folder / "m" / "1" / "model.onnx").unlink()
        (folder / "m" / "1" / "model.onnx").symlink_to(secret)
        _, refused = platform.load("linked.tar.gz", b"")
        assert refused.status == 400, refused.body
        assert "link" in refused.json()["error"]
        assert not any(p.read_bytes() == b"not yours" for p in cache.rglob("*") if p.is_file() and not p.is_symlink())
        assert call(platform.base, "GET", "/models").json() == {"models": []}


OOM_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        raise MemoryError("Failed to allocate memory for the weights")

    def execute(self, requests):
        return []
"""

OOM_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def test_a_framework_out_of_memory_at_load_is_507(platform: Platform) -> None:
    """A load that fails because the framework ran out of memory is 507 (the platform unloads
    models and tries again), as Triton's SageMaker frontend answers it; other failures are 400."""
    name = model_hash("oom.tar.gz")
    write_python(platform.models / name / "model", "oom", OOM_MODEL, OOM_CONFIG)
    url = str(platform.models / name / "model")
    reply = call(platform.base, "POST", "/models", {"model_name": name, "url": url}, {TARGET: "oom.tar.gz"})
    assert reply.status == 507, reply.body
    assert "Failed to allocate memory" in reply.json()["error"]
    assert call(platform.base, "GET", f"/models/{name}").status == 404
