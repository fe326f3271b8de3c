"""TorchScript models through a real server and tritonclient (the PyTorch backend)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from build_repository import SIMPLE_CONFIG, simple_onnx
from tritonclient.utils import InferenceServerException

from support.models import write_onnx
from support.server import QuiverServer

pytest.importorskip("torch")

from support import torch_models as tm


def io(kind: str, entries: list[tuple[str, str, str]]) -> str:
    body = ", ".join(f'{{ name: "{n}" data_type: TYPE_{t} dims: [ {d} ] }}' for n, t, d in entries)
    return f"{kind} [ {body} ]"


def config(name: str, inputs: list[tuple[str, str, str]], outputs: list[tuple[str, str, str]],
           extra: str = "") -> str:
    return f'name: "{name}"\nplatform: "pytorch_libtorch"\n{io("input", inputs)}\n' \
        f'{io("output", outputs)}\n{textwrap.dedent(extra)}'


SHARING = 'parameters { key: "ENABLE_WEIGHT_SHARING" value { string_value: "true" } }'


def build(repo: Path) -> Path:
    repo.mkdir()
    tm.write_torch(repo, "pt_add_sub", tm.script(tm.AddSub()), config(
        "pt_add_sub",
        [("INPUT__1", "FP32", "4"), ("INPUT__0", "FP32", "4")],
        [("OUTPUT__1", "FP32", "4"), ("OUTPUT__0", "FP32", "4")],
        "max_batch_size: 8\n",
    ))
    tm.write_torch(repo, "pt_named", tm.script(tm.ScaleShift()), config(
        "pt_named",
        [("values", "FP32", "-1"), ("scale", "FP32", "1"), ("shift", "FP32", "1")],
        [("result", "FP32", "-1")],
    ))
    tm.write_torch(repo, "pt_tuple", tm.script(tm.AddSub()), config(
        "pt_tuple",
        [("first", "INT64", "-1"), ("second", "INT64", "-1")],
        [("sum", "INT64", "-1"), ("difference", "INT64", "-1")],
    ))
    tm.write_torch(repo, "pt_batched", tm.script(tm.Affine()), config(
        "pt_batched",
        [("INPUT__0", "FP32", "3")],
        [("OUTPUT__0", "FP32", "3")],
        """
        max_batch_size: 16
        dynamic_batching { max_queue_delay_microseconds: 200000 preferred_batch_size: [ 8 ] }
        """,
    ))
    tm.write_torch(repo, "pt_fp16", tm.script(tm.Affine()), config(
        "pt_fp16", [("INPUT__0", "FP16", "-1")], [("OUTPUT__0", "FP16", "-1")],
        'instance_group [ { count: 1 kind: KIND_GPU } ]',
    ))
    counter = [("INPUT__0", "FP32", "1")], [("OUTPUT__0", "FP32", "1")]
    tm.write_torch(repo, "pt_shared", tm.script(tm.Counter()), config(
        "pt_shared", *counter, f"instance_group [ {{ count: 2 kind: KIND_CPU }} ]\n{SHARING}\n",
    ))
    tm.write_torch(repo, "pt_separate", tm.script(tm.Counter()), config(
        "pt_separate", *counter, "instance_group [ { count: 2 kind: KIND_CPU } ]\n",
    ))
    tm.write_torch(repo, "pt_raises", tm.script(tm.Raises()), config(
        "pt_raises", [("x", "FP32", "-1")], [("y", "FP32", "-1")],
    ))
    tm.write_torch(repo, "pt_linear", tm.traced_linear(3, 2), config(
        "pt_linear", [("INPUT__0", "FP32", "-1")], [("OUTPUT__0", "FP32", "2")],
        "max_batch_size: 4\n",
    ))
    tm.write_torch(repo, "pt_strings", tm.script(tm.Upper()), config(
        "pt_strings",
        [("words", "STRING", "-1"), ("x", "INT32", "-1")],
        [("OUTPUT__0", "STRING", "-1"), ("OUTPUT__1", "INT32", "-1")],
    ))
    tm.write_torch(repo, "pt_missing", None, config(
        "pt_missing", [("x", "FP32", "-1")], [("y", "FP32", "-1")],
    ))
    tm.write_torch(repo, "pt_bad_param", tm.script(tm.Affine()), config(
        "pt_bad_param", [("x", "FP32", "-1")], [("y", "FP32", "-1")],
        'parameters { key: "INFERENCE_MODE" value { string_value: "maybe" } }',
    ))
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    repo = build(tmp_path_factory.mktemp("pt") / "models")
    with QuiverServer(repo, args=("--exit-on-error=false",)) as running:
        yield running
    assert running.process is not None
    assert running.process.returncode == 0, running.log


@pytest.fixture(scope="module")
def client(server: QuiverServer) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


def infer(
    client: httpclient.InferenceServerClient,
    model: str,
    arrays: dict[str, np.ndarray],
    datatypes: dict[str, str] | None = None,
) -> httpclient.InferResult:
    inputs = []
    for name, array in arrays.items():
        datatype = (datatypes or {}).get(name) or httpclient.np_to_triton_dtype(array.dtype)
        inp = httpclient.InferInput(name, list(array.shape), datatype)
        inp.set_data_from_numpy(array)
        inputs.append(inp)
    return client.infer(model, inputs)


def test_indexed_names_map_to_positions(client: httpclient.InferenceServerClient) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    y = np.ones((2, 4), dtype=np.float32)
    result = infer(client, "pt_add_sub", {"INPUT__0": x, "INPUT__1": y})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), x + y)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), x - y)
    metadata = client.get_model_metadata("pt_add_sub")
    assert metadata["platform"] == "pytorch_libtorch"
    assert [i["name"] for i in metadata["inputs"]] == ["INPUT__1", "INPUT__0"]


def test_named_arguments_whatever_the_config_order(client: httpclient.InferenceServerClient) -> None:
    result = infer(
        client,
        "pt_named",
        {
            "values": np.array([1, 2, 3], dtype=np.float32),
            "scale": np.array([10], dtype=np.float32),
            "shift": np.array([0.5], dtype=np.float32),
        },
    )
    np.testing.assert_array_equal(result.as_numpy("result"), [10.5, 20.5, 30.5])


def test_tuple_outputs_in_config_order(client: httpclient.InferenceServerClient) -> None:
    first = np.array([5, 7], dtype=np.int64)
    second = np.array([2, 3], dtype=np.int64)
    result = infer(client, "pt_tuple", {"first": first, "second": second})
    np.testing.assert_array_equal(result.as_numpy("sum"), [7, 10])
    np.testing.assert_array_equal(result.as_numpy("difference"), [3, 4])


def test_dynamic_batching_concatenates_and_splits(server: QuiverServer) -> None:
    async def run() -> list[np.ndarray]:
        client = aiohttpclient.InferenceServerClient(server.url)
        try:
            async def one(i: int) -> np.ndarray:
                data = np.full((1, 3), i, dtype=np.float32)
                inp = aiohttpclient.InferInput("INPUT__0", [1, 3], "FP32")
                inp.set_data_from_numpy(data)
                result = await client.infer("pt_batched", [inp])
                return result.as_numpy("OUTPUT__0")  # type: ignore[no-any-return]

            return list(await asyncio.gather(*(one(i) for i in range(8))))
        finally:
            await client.close()

    outputs = asyncio.run(run())
    for i, output in enumerate(outputs):
        np.testing.assert_array_equal(output, np.full((1, 3), 2 * i + 1, dtype=np.float32))
    stats = httpclient.InferenceServerClient(server.url).get_inference_statistics("pt_batched")
    model = stats["model_stats"][0]
    assert model["inference_count"] == 8
    assert model["execution_count"] < 8  # at least some requests ran together


def test_fp16_on_a_gpu_group_falls_back_to_cpu(
    client: httpclient.InferenceServerClient, server: QuiverServer
) -> None:
    data = np.array([1.5, -2.25, 100.0], dtype=np.float16)
    result = infer(client, "pt_fp16", {"INPUT__0": data})
    got = result.as_numpy("OUTPUT__0")
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, data * 2 + 1)
    assert "model 'pt_fp16' instance" in server.log and "running on the CPU" in server.log


def test_bytes_as_lists_of_strings(client: httpclient.InferenceServerClient) -> None:
    words = np.array([b"triton", b"quiver"], dtype=np.object_)
    inputs = [httpclient.InferInput("words", [2], "BYTES"), httpclient.InferInput("x", [1], "INT32")]
    inputs[0].set_data_from_numpy(words)
    inputs[1].set_data_from_numpy(np.array([21], dtype=np.int32))
    result = client.infer("pt_strings", inputs)
    assert list(result.as_numpy("OUTPUT__0")) == [b"TRITON", b"QUIVER"]
    assert result.as_numpy("OUTPUT__1").tolist() == [42]


def counts(client: httpclient.InferenceServerClient, model: str, n: int) -> list[float]:
    zero = np.zeros(1, dtype=np.float32)
    return [float(infer(client, model, {"INPUT__0": zero}).as_numpy("OUTPUT__0")[0]) for _ in range(n)]


def test_two_instances_share_one_module_with_weight_sharing(
    client: httpclient.InferenceServerClient, server: QuiverServer
) -> None:
    # The model counts its executions in a buffer. Requests one after the other alternate
    # between the two instances: one shared module counts 1, 2, 3, 4; two modules 1, 1, 2, 2.
    assert counts(client, "pt_shared", 4) == [1, 2, 3, 4]
    assert counts(client, "pt_separate", 4) == [1, 1, 2, 2]
    assert "reusing the loaded TorchScript module" in server.log


def test_an_exception_in_forward_is_a_500_naming_the_model(
    client: httpclient.InferenceServerClient,
) -> None:
    with pytest.raises(InferenceServerException) as info:
        infer(client, "pt_raises", {"x": np.array([-1, -2], dtype=np.float32)})
    assert info.value.status() == "500"
    assert "model 'pt_raises'" in info.value.message()
    assert "negative input is not allowed" in info.value.message()
    # the model and the server keep serving
    ok = infer(client, "pt_raises", {"x": np.array([1, 2], dtype=np.float32)})
    assert ok.as_numpy("y").tolist() == [1, 2]
    assert client.is_server_live()


def test_a_shape_the_model_cannot_take_is_a_400(client: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as info:
        infer(client, "pt_linear", {"INPUT__0": np.ones((1, 5), dtype=np.float32)})
    assert info.value.status() == "400"
    assert "model 'pt_linear'" in info.value.message()
    good = infer(client, "pt_linear", {"INPUT__0": np.ones((2, 3), dtype=np.float32)})
    assert good.as_numpy("OUTPUT__0").shape == (2, 2)


def test_load_failures_say_why(client: httpclient.InferenceServerClient) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index()}
    missing = index["pt_missing"]
    assert missing["state"] == "UNAVAILABLE"
    assert "model.pt" in missing["reason"] and "does not exist" in missing["reason"]
    bad = index["pt_bad_param"]
    assert bad["state"] == "UNAVAILABLE"
    assert "INFERENCE_MODE" in bad["reason"] and "config.pbtxt" in bad["reason"]
    assert "'maybe'" in bad["reason"]


# --- without torch ----------------------------------------------------------------------

#: Runs `quiver` in a process where `import torch` fails, as on an install without the extra.
NO_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
from quiver.cli import main
sys.exit(main(sys.argv[1:]))
"""


class NoTorchServer(QuiverServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", NO_TORCH, *super().command()[3:]]


def test_without_torch_the_server_serves_the_rest_and_says_what_to_install(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    write_onnx(repo, "simple", simple_onnx(), SIMPLE_CONFIG)
    tm.write_torch(repo, "pt_model", tm.script(tm.Affine()), config(
        "pt_model", [("x", "FP32", "-1")], [("y", "FP32", "-1")],
    ))
    with NoTorchServer(repo, args=("--exit-on-error=false",)) as running:
        client = httpclient.InferenceServerClient(running.url)
        assert client.is_model_ready("simple")
        assert not client.is_model_ready("pt_model")
        reason = {m["name"]: m for m in client.get_model_repository_index()}["pt_model"]["reason"]
        assert "pip install 'quiver[torch]'" in reason
    # and with --exit-on-error (the default) start-up fails with the same message
    failed = subprocess.run(
        NoTorchServer(repo).command(), capture_output=True, text=True, timeout=60
    )
    assert failed.returncode != 0
    assert "pip install 'quiver[torch]'" in failed.stdout + failed.stderr
