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
