"""Model warmup (config.pbtxt ``model_warmup``) against a real server."""

from __future__ import annotations

import json
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from support.models import add_constant_onnx, write_onnx, write_python
from support.server import QuiverServer

#: Records every execution: instance, request ids, and each request's inputs.
RECORDING_MODEL = """
import json, time
from pathlib import Path
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = Path(args["model_repository"]) / "executions.jsonl"
        self.instance = args["model_instance_name"]
        self.fail = args["model_name"].startswith("failing")

    def execute(self, requests):
        if self.fail:
            raise RuntimeError("this model cannot run")
        inputs = []
        for r in requests:
            image = pb_utils.get_input_tensor_by_name(r, "IMAGE").as_numpy()
            text = pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy()
            inputs.append({"image": image.tolist(), "image_dtype": str(image.dtype),
                           "text": [t.decode() for t in text.reshape(-1)]})
        if any(r.request_id().startswith("warmup") for r in requests):
            time.sleep(0.1)
        with self.log.open("a") as f:
            f.write(json.dumps({"instance": self.instance, "ids": [r.request_id() for r in requests],
                                "inputs": inputs, "time": time.monotonic()}) + "\\n")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones((1, 1), np.float32))])
                for r in requests]
"""

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 4
input [ {{ name: "IMAGE" data_type: TYPE_FP32 dims: [ 2 ] }}, {{ name: "TEXT" data_type: TYPE_STRING dims: [ 2 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
{warmup}
"""

TEXT_ZERO = 'inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 2 ] zero_data: true } }'

GOOD_WARMUP = f"""
model_warmup [
  {{ name: "zeros" batch_size: 1 count: 3
     inputs {{ key: "IMAGE" value: {{ data_type: TYPE_FP32 dims: [ 2 ] zero_data: true }} }} {TEXT_ZERO} }},
  {{ name: "random" batch_size: 2
     inputs {{ key: "IMAGE" value: {{ data_type: TYPE_FP32 dims: [ 2 ] random_data: true }} }}
     inputs {{ key: "TEXT" value: {{ data_type: TYPE_STRING dims: [ 2 ] random_data: true }} }} }},
  {{ name: "files" batch_size: 1 count: 2
     inputs {{ key: "IMAGE" value: {{ data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "image.bin" }} }}
     inputs {{ key: "TEXT" value: {{ data_type: TYPE_STRING dims: [ 2 ] input_data_file: "text.bin" }} }} }}
]
"""


def sample(name: str, image: str, batch_size: int = 1, extra: str = TEXT_ZERO) -> str:
    return (
        f'model_warmup [ {{ name: "{name}" batch_size: {batch_size} '
        f'inputs {{ key: "IMAGE" value: {{ data_type: TYPE_FP32 dims: [ 2 ] {image} }} }} {extra} }} ]'
    )


BROKEN = {
    "unknown_input": (
        sample("s1", "zero_data: true", extra=TEXT_ZERO + ' inputs { key: "OTHER" value: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } }'),
        "warmup sample 's1': input 'OTHER' is not an input of the model",
    ),
    "wrong_type": (
        sample("s2", "zero_data: true", extra='inputs { key: "TEXT" value: { data_type: TYPE_INT32 dims: [ 2 ] zero_data: true } }'),
        "warmup sample 's2': input 'TEXT' is TYPE_INT32 in the warmup sample but TYPE_STRING",
    ),
    "missing_file": (
        sample("s3", 'input_data_file: "nothing.bin"'),
        "warmup sample 's3': input 'IMAGE': cannot read input_data_file",
    ),
    "short_file": (
        sample("s4", 'input_data_file: "short.bin"'),
        "warmup sample 's4': input 'IMAGE': input_data_file",
    ),
    "too_big": (
        sample("s5", "zero_data: true", batch_size=5),
        "warmup sample 's5': batch_size 5 is larger than the model's max_batch_size 4",
    ),
    "failing": (
        sample("s6", "zero_data: true"),
        "warmup sample 's6' on instance failing_0_0 failed",
    ),
}

ONNX_CONFIG = """
name: "onnx_warm"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
model_warmup [ { name: "w" batch_size: 8 count: 5
  inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 4 ] random_data: true } } } ]
"""

IMAGE_VALUES = [1.5, -2.25]
TEXT_VALUES = [b"hello", b"warm"]


def write_files(folder: Path) -> None:
    (folder / "warmup").mkdir(exist_ok=True)
    (folder / "warmup" / "image.bin").write_bytes(np.asarray(IMAGE_VALUES, np.float32).tobytes())
    (folder / "warmup" / "text.bin").write_bytes(b"".join(struct.pack("<I", len(t)) + t for t in TEXT_VALUES))
    (folder / "warmup" / "short.bin").write_bytes(b"\0" * 7)


def records(folder: Path) -> list[dict[str, object]]:
    path = folder / "executions.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("warmup")
    write_files(write_python(root, "warm", RECORDING_MODEL, CONFIG.format(name="warm", warmup=GOOD_WARMUP)))
    for name, (warmup, _) in BROKEN.items():
        write_files(write_python(root, name, RECORDING_MODEL, CONFIG.format(name=name, warmup=warmup)))
    write_onnx(root, "onnx_warm", add_constant_onnx(1.0), ONNX_CONFIG)
    return root


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[QuiverServer]:
    with QuiverServer(repo, args=("--exit-on-error=false",)) as running:
        yield running


def test_each_sample_runs_count_times_on_every_instance(server: QuiverServer, repo: Path) -> None:
    client = httpclient.InferenceServerClient(server.url)
    assert client.is_model_ready("warm")
    runs = records(repo / "warm")
    by_instance: dict[str, list[str]] = {}
    for run in runs:
        ids = run["ids"]
        assert isinstance(ids, list)
        by_instance.setdefault(str(run["instance"]), []).append(str(ids[0]).split(":")[1])
        assert {str(i).split(":")[1] for i in ids} == {str(ids[0]).split(":")[1]}  # one sample per execution
    # Every instance ran zeros x3, random x1 (one execution of 2 requests), files x2, in order.
    expected = ["zeros"] * 3 + ["random"] + ["files"] * 2
    assert by_instance == {"warm_0_0": expected, "warm_0_1": expected}
    for run in runs:
        sample = str(run["ids"][0]).split(":")[1]  # type: ignore[index]
        inputs = run["inputs"]
        assert isinstance(inputs, list)
        if sample == "zeros":
            assert inputs == [{"image": [[0.0, 0.0]], "image_dtype": "float32", "text": ["", ""]}]
        elif sample == "random":
            assert len(inputs) == 2 and len(run["ids"]) == 2  # type: ignore[arg-type]
            for item in inputs:
                assert item["text"] == ["", ""]  # random BYTES are empty, as in Triton
                assert all(0.0 <= v < 1.0 for v in item["image"][0])
                assert item["image_dtype"] == "float32"
        else:
            assert inputs == [{"image": [IMAGE_VALUES], "image_dtype": "float32", "text": ["hello", "warm"]}]
    # Warmup counts in no statistics.
    stats = client.get_inference_statistics("warm")["model_stats"][0]
    assert stats["inference_count"] == 0 and stats["execution_count"] == 0
    assert "model 'warm' version 1: warmed up with 3 sample(s)" in server.log


def test_warmup_runs_before_ready(tmp_path: Path) -> None:
    """While warmup runs the model is not ready; once it is ready every run has happened."""
    folder = write_python(tmp_path, "warm", RECORDING_MODEL, CONFIG.format(name="warm", warmup=GOOD_WARMUP))
    write_files(folder)
    with QuiverServer(tmp_path, args=("--model-control-mode=explicit",)) as running:
        # urllib, not tritonclient: its gevent client cannot be shared with a thread.
        def load() -> None:
            request = urllib.request.Request(f"{running.http}/v2/repository/models/warm/load", data=b"", method="POST")
            with urllib.request.urlopen(request, timeout=60) as response:
                assert response.status == 200

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{running.http}/v2/models/warm/ready", timeout=10) as response:
                    return bool(response.status == 200)
            except urllib.error.HTTPError:
                return False

        loader = threading.Thread(target=load)
        loader.start()
        seen_partial_while_unready = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done = len(records(tmp_path / "warm"))
            if ready():
                assert done == 12 and len(records(tmp_path / "warm")) == 12
                break
            if 0 < done < 12:
                seen_partial_while_unready = True
            time.sleep(0.02)
        loader.join()
        assert ready()
        assert seen_partial_while_unready
        assert len(records(tmp_path / "warm")) == 12  # 6 executions x 2 instances


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_failed_warmup_makes_the_model_unavailable(server: QuiverServer, name: str) -> None:
    client = httpclient.InferenceServerClient(server.url)
    assert not client.is_model_ready(name)
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index[name]["state"] == "UNAVAILABLE"
    reason = index[name]["reason"]
    assert f"model '{name}'" in reason and BROKEN[name][1] in reason, reason
    if name == "failing":
        assert "this model cannot run" in reason


def test_onnx_warmup_on_the_thread_and_inline(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    assert client.is_model_ready("onnx_warm")
    x = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    x.set_data_from_numpy(np.zeros((1, 4), np.float32))
    np.testing.assert_allclose(client.infer("onnx_warm", [x]).as_numpy("OUTPUT0"), np.ones((1, 4)))
    stats = client.get_inference_statistics("onnx_warm")["model_stats"][0]
    assert stats["inference_count"] == 1 and stats["execution_count"] == 1
