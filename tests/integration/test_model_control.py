"""Model control modes and the repository extension: index, load (with config and files), unload."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from build_repository import SIMPLE_CONFIG, simple_onnx
from tritonclient.utils import InferenceServerException

from support.models import add_constant_onnx, write_onnx, write_python
from support.server import QuiverServer

ADD_CONFIG = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""

SLOW_MODEL = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(1.0)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
"""

SLOW_CONFIG = """
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def add_input(value: float = 0.0) -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.full((1, 4), value, dtype=np.float32))
    return [inp]


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


@pytest.fixture
def explicit(tmp_path: Path) -> Iterator[tuple[QuiverServer, httpclient.InferenceServerClient, Path]]:
    repo = tmp_path / "repo"
    repo.mkdir()
    write_onnx(repo, "simple", simple_onnx(), SIMPLE_CONFIG)
    write_onnx(repo, "add", add_constant_onnx(1.0), ADD_CONFIG.format(name="add"))
    write_python(repo, "slow", SLOW_MODEL, SLOW_CONFIG)
    with QuiverServer(repo, args=("--model-control-mode=explicit", "--load-model", "simple")) as server:
        yield server, httpclient.InferenceServerClient(server.url, network_timeout=30), repo


def index(client: httpclient.InferenceServerClient) -> dict[str, dict[str, str]]:
    return {entry["name"]: entry for entry in client.get_model_repository_index()}


def test_explicit_mode_loads_only_what_it_is_told(explicit) -> None:  # type: ignore[no-untyped-def]
    _, client, _ = explicit
    entries = index(client)
    assert entries["simple"]["state"] == "READY" and entries["simple"]["version"] == "1"
    assert entries["add"] == {"name": "add"}  # in the repository, never loaded
    assert not client.is_model_ready("add")
    assert [e["name"] for e in client.get_model_repository_index() if e.get("state") == "READY"] == ["simple"]

    client.load_model("add")
    assert client.is_model_ready("add")
    np.testing.assert_array_equal(client.infer("add", add_input(2.0)).as_numpy("OUTPUT0"), np.full((1, 4), 3.0))

    client.unload_model("add")
    assert not client.is_model_ready("add")
    entry = index(client)["add"]
    assert entry["state"] == "UNAVAILABLE" and entry["reason"] == "unloaded"
    with pytest.raises(InferenceServerException) as info:
        client.infer("add", add_input())
    assert info.value.status() == "503"


def test_load_errors(explicit) -> None:  # type: ignore[no-untyped-def]
    _, client, _ = explicit
    with pytest.raises(InferenceServerException) as info:
        client.load_model("no_such_model")
    assert info.value.status() == "404" and "no model named 'no_such_model'" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.load_model("simple", config="{not json")
    assert info.value.status() == "400" and "config parameter" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.unload_model("no_such_model")
    assert info.value.status() == "404"
    assert client.is_model_ready("simple")


def test_load_with_config_override(explicit) -> None:  # type: ignore[no-untyped-def]
    _, client, _ = explicit
    config = client.get_model_config("simple")
    config["max_batch_size"] = 2
    client.load_model("simple", config=json.dumps(config))
    assert client.get_model_config("simple")["max_batch_size"] == 2
    client.load_model("simple")  # back to the repository's config.pbtxt
    assert client.get_model_config("simple")["max_batch_size"] == 8


def test_load_with_files_in_the_request(explicit) -> None:  # type: ignore[no-untyped-def]
    _, client, _ = explicit
    model = add_constant_onnx(10.0).SerializeToString()
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
    np.testing.assert_array_equal(client.infer("uploaded", add_input(1.0)).as_numpy("OUTPUT0"), np.full((1, 4), 11.0))

    with pytest.raises(InferenceServerException) as info:
        client.load_model("evil", config=config.replace("uploaded", "evil"), files={"file:../../etc/x": b"x"})
    assert info.value.status() == "400" and "inside a version folder" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.load_model("junk", config=config.replace("uploaded", "junk"), files={"file:1/model.onnx": b"not onnx"})
    assert info.value.status() == "400" and "onnxruntime could not load" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.load_model("noconfig", files={"file:1/model.onnx": model})
    assert info.value.status() == "400" and "need the 'config' parameter" in info.value.message()
    client.unload_model("uploaded")
    assert not client.is_model_ready("uploaded")


def test_failed_reload_keeps_the_old_version_serving(explicit) -> None:  # type: ignore[no-untyped-def]
    _, client, repo = explicit
    (repo / "simple" / "config.pbtxt").write_text('name: "simple"\nbackend: "onnxruntime"\nbogus: 1\n')
    with pytest.raises(InferenceServerException) as info:
        client.load_model("simple")
    assert "bogus" in info.value.message()
    assert client.is_model_ready("simple")
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for inp in inputs:
        inp.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), np.full((1, 16), 2))


def test_unload_lets_in_flight_requests_finish(explicit) -> None:  # type: ignore[no-untyped-def]
    server, client, _ = explicit
    client.load_model("slow")
    outcome: dict[str, object] = {}

    def call() -> None:
        inp = httpclient.InferInput("INPUT0", [1], "FP32")
        inp.set_data_from_numpy(np.array([7.0], dtype=np.float32))
        outcome["value"] = httpclient.InferenceServerClient(server.url, network_timeout=30).infer("slow", [inp]).as_numpy("OUTPUT0")

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)
    client.unload_model("slow")  # returns once the in-flight request has finished
    thread.join(10)
    np.testing.assert_array_equal(outcome["value"], [7.0])
    assert not client.is_model_ready("slow")


def test_concurrent_load_and_unload_end_in_one_state(explicit) -> None:  # type: ignore[no-untyped-def]
    server, client, _ = explicit
    errors: list[BaseException] = []

    def worker(action: str) -> None:
        c = httpclient.InferenceServerClient(server.url, network_timeout=30)
        try:
            for _ in range(4):
                (c.load_model if action == "load" else c.unload_model)("add")
        except BaseException as exc:  # collected and checked below
            errors.append(exc)
        finally:
            c.close()  # in its own thread: gevent's pool cannot be joined from another one

    threads = [threading.Thread(target=worker, args=(a,)) for a in ("load", "unload", "load")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    state = index(client)["add"].get("state")
    assert state in ("READY", "UNAVAILABLE")
    assert client.is_model_ready("add") == (state == "READY")
    client.load_model("add")
    np.testing.assert_array_equal(client.infer("add", add_input()).as_numpy("OUTPUT0"), np.full((1, 4), 1.0))


def test_none_mode_refuses_load_and_unload(tmp_path: Path) -> None:
    write_onnx(tmp_path, "simple", simple_onnx(), SIMPLE_CONFIG)
    with QuiverServer(tmp_path) as server:
        client = httpclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException) as info:
            client.unload_model("simple")
        # Triton's code and text (503 UNAVAILABLE), with the way out
        assert info.value.status() == "503" and "--model-control-mode=explicit" in info.value.message()
        assert "explicit model load / unload is not allowed if polling is enabled" in info.value.message()
        assert client.is_model_ready("simple")


def test_poll_mode_follows_the_repository(tmp_path: Path) -> None:
    write_onnx(tmp_path, "add", add_constant_onnx(1.0), ADD_CONFIG.format(name="add"))
    with QuiverServer(tmp_path, args=("--model-control-mode=poll", "--repository-poll-secs", "0.3")) as server:
        client = httpclient.InferenceServerClient(server.url)
        assert client.is_model_ready("add")
        # A new model appears.
        write_onnx(tmp_path, "add_b", add_constant_onnx(5.0), ADD_CONFIG.format(name="add_b"))
        eventually(lambda: client.is_model_ready("add_b"))
        # A new version of a model: the latest-1 policy moves to it.
        write_onnx(tmp_path, "add", add_constant_onnx(2.0), None, version=2)
        eventually(lambda: client.is_model_ready("add", "2"))
        np.testing.assert_array_equal(client.infer("add", add_input()).as_numpy("OUTPUT0"), np.full((1, 4), 2.0))
        assert not client.is_model_ready("add", "1")
        # A broken change: the served version keeps serving.
        (tmp_path / "add" / "config.pbtxt").write_text("garbage {")
        time.sleep(1.0)
        assert client.is_model_ready("add", "2")
        # A model disappears.
        shutil.rmtree(tmp_path / "add_b")
        eventually(lambda: not client.is_model_ready("add_b"))
        assert index(client)["add_b"]["reason"] == "removed from the model repository"


def test_config_file_names_cannot_leave_the_model_folder(explicit) -> None:  # type: ignore[no-untyped-def]
    _, client, _ = explicit
    config = client.get_model_config("simple")
    for field, value in (("default_model_filename", "/etc/passwd"), ("default_model_filename", "../simple/1/model.onnx")):
        bad = dict(config, **{field: value})
        with pytest.raises(InferenceServerException) as info:
            client.load_model("simple", config=json.dumps(bad))
        assert info.value.status() == "400" and "inside the model's folder" in info.value.message()
    bad = json.loads(json.dumps(config))
    bad["output"][0]["label_filename"] = "/etc/passwd"
    with pytest.raises(InferenceServerException) as info:
        client.load_model("simple", config=json.dumps(bad))
    assert "label_filename" in info.value.message()
    assert client.is_model_ready("simple")


def test_model_names_from_requests_are_folder_names(explicit) -> None:  # type: ignore[no-untyped-def]
    import tritonclient.grpc as grpcclient

    server, _, _ = explicit
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for name in ("a/../../escape", "..", "x\\y"):
        with pytest.raises(InferenceServerException) as info:
            client.load_model(name, config="{}", files={"file:1/model.py": b"x"})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", name
        assert "not a valid model name" in info.value.message()


def test_a_failed_reload_keeps_the_served_files(explicit) -> None:  # type: ignore[no-untyped-def]
    _, client, _ = explicit
    reader = (
        b"import numpy as np, triton_python_backend_utils as pb_utils\\n"
        b"from pathlib import Path\\n"
        b"class TritonPythonModel:\\n"
        b"    def initialize(self, args):\\n"
        b"        self.path = Path(__file__).parent / 'data.txt'\\n"
        b"    def execute(self, requests):\\n"
        b"        v = float(self.path.read_text())\\n"
        b"        return [pb_utils.InferenceResponse([pb_utils.Tensor('OUTPUT0', np.array([v], np.float32))]) for r in requests]\\n"
    ).decode("unicode_escape").encode()
    config = json.dumps(
        {
            "name": "ov",
            "backend": "python",
            "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [1]}],
            "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [1]}],
        }
    )
    client.load_model("ov", config=config, files={"file:1/model.py": reader, "file:1/data.txt": b"5"})
    inp = httpclient.InferInput("INPUT0", [1], "FP32")
    inp.set_data_from_numpy(np.zeros(1, np.float32))
    assert client.infer("ov", [inp]).as_numpy("OUTPUT0").tolist() == [5.0]
    with pytest.raises(InferenceServerException):
        client.load_model("ov", config=config, files={"file:1/model.py": b"raise SystemExit('broken')"})
    assert client.infer("ov", [inp]).as_numpy("OUTPUT0").tolist() == [5.0]
