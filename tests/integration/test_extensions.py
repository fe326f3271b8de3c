"""Statistics and logging extensions over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from build_repository import SIMPLE_CONFIG, simple_onnx
from tritonclient.utils import InferenceServerException

from support.models import write_onnx
from support.server import QuiverServer, run_quiver


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpclient.InferenceServerClient]:
    repo = tmp_path_factory.mktemp("stats")
    write_onnx(repo, "simple", simple_onnx(), SIMPLE_CONFIG)
    with QuiverServer(repo) as server:
        yield httpclient.InferenceServerClient(server.url)


def simple_request(batch: int) -> list[httpclient.InferInput]:
    inputs = [httpclient.InferInput(n, [batch, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for inp in inputs:
        inp.set_data_from_numpy(np.ones((batch, 16), dtype=np.int32))
    return inputs


def test_statistics_add_up(client: httpclient.InferenceServerClient) -> None:
    before = client.get_inference_statistics("simple")["model_stats"][0]
    assert before["inference_count"] == 0 and before["execution_count"] == 0
    for batch in (1, 1, 2, 4):
        client.infer("simple", simple_request(batch))
    bad = [httpclient.InferInput("INPUT0", [1, 3], "INT32")]
    bad[0].set_data_from_numpy(np.ones((1, 3), dtype=np.int32))
    for _ in range(3):
        with pytest.raises(InferenceServerException):
            client.infer("simple", bad)

    stats = client.get_inference_statistics("simple", "1")["model_stats"][0]
    assert (stats["name"], stats["version"]) == ("simple", "1")
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == 4
    assert inference["fail"]["count"] == 3
    assert stats["inference_count"] == 8  # rows: 1 + 1 + 2 + 4
    assert stats["execution_count"] == 4
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[phase]["count"] == 4
    assert inference["success"]["ns"] >= inference["compute_infer"]["ns"] > 0
    batches = {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}
    assert batches == {1: 2, 2: 1, 4: 1}
    assert stats["last_inference"] > 0

    everything = client.get_inference_statistics()["model_stats"]
    assert [s["name"] for s in everything] == ["simple"]
    with pytest.raises(InferenceServerException) as info:
        client.get_inference_statistics("nope")
    assert info.value.status() == "404"


def test_log_settings_round_trip(client: httpclient.InferenceServerClient, tmp_path: Path) -> None:
    settings = client.get_log_settings()
    assert settings["log_info"] is True and settings["log_verbose_level"] == 0
    updated = client.update_log_settings({"log_verbose_level": 1})
    assert updated["log_verbose_level"] == 1
    assert client.get_log_settings()["log_verbose_level"] == 1
    client.update_log_settings({"log_verbose_level": 0})
    with pytest.raises(InferenceServerException) as info:
        client.update_log_settings({"log_colour": "blue"})
    assert info.value.status() == "400" and "log_colour" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.update_log_settings({"log_info": "yes"})
    assert info.value.status() == "400"


def test_server_metadata_lists_the_extensions(client: httpclient.InferenceServerClient) -> None:
    extensions = client.get_server_metadata()["extensions"]
    for name in ("model_repository", "statistics", "logging", "binary_tensor_data", "classification"):
        assert name in extensions


def test_restricted_apis_need_their_header(tmp_path: Path) -> None:
    write_onnx(tmp_path, "simple", simple_onnx(), SIMPLE_CONFIG)
    args = (
        "--model-control-mode=explicit",
        "--load-model=simple",
        "--http-restricted-api",
        "model-repository,logging:admin-key=s3cret",
    )
    with QuiverServer(tmp_path, args=args) as server:
        client = httpclient.InferenceServerClient(server.url)
        assert client.is_server_ready()  # health is not restricted
        client.infer("simple", simple_request(1))  # nor is inference
        with pytest.raises(InferenceServerException) as info:
            client.get_model_repository_index()
        assert info.value.status() == "403" and "expecting header 'admin-key'" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            client.unload_model("simple", headers={"admin-key": "wrong"})
        assert info.value.status() == "403"
        assert client.is_model_ready("simple")
        client.unload_model("simple", headers={"admin-key": "s3cret"})
        assert not client.is_model_ready("simple")
        assert client.get_log_settings(headers={"Admin-Key": "s3cret"})["log_info"] is True


def test_bad_restricted_api_spec_fails_start_up(tmp_path: Path) -> None:
    result = run_quiver("serve", "--model-repository", str(tmp_path), "--http-restricted-api", "everything:k=v")
    assert result.returncode == 2 and "unknown API 'everything'" in result.stderr


def test_grpc_repository_statistics_and_logging(tmp_path: Path) -> None:
    import json

    import tritonclient.grpc as grpcclient

    from support.models import add_constant_onnx

    write_onnx(tmp_path, "simple", simple_onnx(), SIMPLE_CONFIG)
    args = ("--model-control-mode=explicit", "--load-model=simple")
    with QuiverServer(tmp_path, args=args) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        index = client.get_model_repository_index(as_json=True)["models"]
        assert index == [{"name": "simple", "version": "1", "state": "READY"}]
        model = add_constant_onnx(4.0).SerializeToString()
        config = json.dumps(
            {
                "name": "uploaded",
                "backend": "onnxruntime",
                "max_batch_size": 8,
                "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
                "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
            }
        )
        client.load_model("uploaded", config=config, files={"file:1/model.onnx": model})
        assert client.is_model_ready("uploaded")
        inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 4), dtype=np.float32))
        assert client.infer("uploaded", [inp]).as_numpy("OUTPUT0").tolist() == [[4.0] * 4]
        stats = client.get_inference_statistics("uploaded", as_json=True)["model_stats"][0]
        assert stats["name"] == "uploaded" and int(stats["inference_count"]) == 1
        assert int(stats["inference_stats"]["success"]["count"]) == 1
        client.unload_model("uploaded")
        assert not client.is_model_ready("uploaded")
        with pytest.raises(InferenceServerException) as info:
            client.load_model("missing")
        assert info.value.status() == "StatusCode.NOT_FOUND"
        settings = client.update_log_settings({"log_verbose_level": 2}, as_json=True)["settings"]
        assert settings["log_verbose_level"] == {"uint32_param": 2}
        client.update_log_settings({"log_verbose_level": 0})
        with pytest.raises(InferenceServerException) as info:
            client.get_inference_statistics("nope")
        assert info.value.status() == "StatusCode.NOT_FOUND"


def test_grpc_restricted_protocol(tmp_path: Path) -> None:
    import tritonclient.grpc as grpcclient

    write_onnx(tmp_path, "simple", simple_onnx(), SIMPLE_CONFIG)
    with QuiverServer(tmp_path, args=("--grpc-restricted-protocol", "model-repository,inference:api-key=k1")) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        assert client.is_server_live()
        with pytest.raises(InferenceServerException) as info:
            client.get_model_repository_index()
        assert info.value.status() == "StatusCode.PERMISSION_DENIED"
        assert "expecting header 'api-key'" in info.value.message()
        assert client.get_model_repository_index(headers={"api-key": "k1"}) is not None
        inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for inp in inputs:
            inp.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
        with pytest.raises(InferenceServerException) as info:
            client.infer("simple", inputs)
        assert info.value.status() == "StatusCode.PERMISSION_DENIED"
        assert client.infer("simple", inputs, headers={"api-key": "k1"}).as_numpy("OUTPUT0")[0][0] == 2


def test_restriction_groups_follow_the_route_not_the_model_name(tmp_path: Path) -> None:
    from build_repository import simple_onnx as model

    write_onnx(tmp_path, "ready", model(), SIMPLE_CONFIG.replace('name: "simple"', 'name: "ready"'))
    with QuiverServer(tmp_path, args=("--http-restricted-api", "metadata:k=v")) as server:
        client = httpclient.InferenceServerClient(server.url)
        assert client.is_model_ready("ready")  # health stays open
        with pytest.raises(InferenceServerException) as info:
            client.get_model_metadata("ready")  # GET /v2/models/ready is metadata
        assert info.value.status() == "403"
