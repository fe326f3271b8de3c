"""Every ``tritonserver`` flag starts Quiver: the ones it applies change its behaviour (``--id``,
``--strict-readiness``, header forwarding, ``--model-load-retry-count``,
``--disable-auto-complete-config``, ``--log-warning``/``--log-error``, gRPC TLS), the others
are accepted with one log line each saying why they have no effect."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from build_repository import SIMPLE_CONFIG, simple_onnx
from tritonclient.utils import InferenceServerException

from quiver.triton_flags import NO_EFFECT
from support.models import write_onnx, write_python
from support.server import QuiverServer

ECHO_PARAMETERS = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = np.array([request.parameters().encode()], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PARAMETERS", text)]))
        return responses
"""

ECHO_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "PARAMETERS" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

#: Fails its first initialize (leaving a marker), succeeds on the next.
FLAKY_MODEL = """
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        marker = os.path.join(os.path.dirname(__file__), "..", "tried")
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("first load fails")

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
            )
            for r in requests
        ]
"""

FLAKY_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

#: A value for each flag that has no effect (Triton's syntax).
NO_EFFECT_VALUES = {
    "--enable-peer-access": "false",
    "--http-thread-count": "8",
    "--grpc-infer-thread-count": "4",
    "--grpc-infer-allocation-pool-size": "8",
    "--grpc-max-response-pool-size": "16",
    "--allow-vertex-ai": "false",
    "--vertex-ai-port": "8080",
    "--vertex-ai-thread-count": "4",
    "--vertex-ai-default-model": "simple",
    "--metrics-config": "summary_latencies=true",
    "--rate-limit": "off",
    "--rate-limit-resource": "R1:10:0",
    "--pinned-memory-pool-byte-size": "268435456",
    "--cuda-memory-pool-byte-size": "0:67108864",
    "--cuda-virtual-address-size": "0:1073741824",
    "--min-supported-compute-capability": "6.0",
    "--buffer-manager-thread-count": "2",
    "--host-policy": "numa0,numa-node=0",
    "--backend-directory": "/opt/tritonserver/backends",
    "--repoagent-directory": "/opt/tritonserver/repoagents",
}


def _repository(root: Path, *, flaky: bool = False, broken: bool = False) -> Path:
    repo = root / "models"
    repo.mkdir()
    folder = write_onnx(repo, "simple", simple_onnx(), SIMPLE_CONFIG)
    (folder / "configs").mkdir()  # --model-config-name=h100 picks this one
    (folder / "configs" / "h100.pbtxt").write_text(SIMPLE_CONFIG.replace("max_batch_size: 8", "max_batch_size: 4"))
    write_onnx(repo, "no_config", simple_onnx(), None)  # completed from the model, unless disabled
    write_python(repo, "echo", ECHO_PARAMETERS, ECHO_CONFIG)
    if flaky:
        write_python(repo, "flaky", FLAKY_MODEL, FLAKY_CONFIG)
    if broken:
        folder = repo / "broken" / "1"
        folder.mkdir(parents=True)
        (folder / "model.onnx").write_bytes(b"not a model")
        (repo / "broken" / "config.pbtxt").write_text(
            'backend: "onnxruntime"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [1] } ]\n'
            'output [ { name: "Y" data_type: TYPE_FP32 dims: [1] } ]\n'
        )
    return repo


@pytest.fixture(scope="module", params=["one-process", "frontend-workers"])
def launch_script_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    """A server started with a Triton launch script's flags; then with frontend workers, which
    apply the gRPC flags (keepalive, compression, header forwarding) as the process does."""
    repo = _repository(tmp_path_factory.mktemp("flags"), flaky=True)
    args = [
        "--id=triton-a",
        "--model-config-name=h100",
        "--exit-on-error=false",
        "--strict-readiness=true",
        "--disable-auto-complete-config",
        "--model-load-retry-count=1",
        "--exit-timeout-secs=5",
        "--log-warning=false",
        "--log-error=true",
        "--http-header-forward-pattern=^X-App-",
        "--grpc-header-forward-pattern=^x-app-",
        "--reuse-http-port=false",
        "--grpc-keepalive-time=7200000",
        "--grpc-keepalive-timeout=20000",
        "--grpc-keepalive-permit-without-calls=false",
        "--grpc-http2-max-pings-without-data=2",
        "--grpc-http2-min-recv-ping-interval-without-data=300000",
        "--grpc-http2-max-ping-strikes=2",
        "--grpc-infer-response-compression-level=none",
        "--model-load-gpu-limit=0:0.8",
        "--metrics-interval-ms=2000.0",
    ]
    args += [f"{flag}={value}" for flag, value in NO_EFFECT_VALUES.items()]
    if request.param == "frontend-workers":
        args += ["--frontend-workers=2"]
    with QuiverServer(repo, args=tuple(args)) as running:
        yield running


def test_every_no_effect_flag_is_accepted_with_one_log_line(launch_script_server: QuiverServer) -> None:
    assert set(NO_EFFECT_VALUES) == set(NO_EFFECT)  # the test gives every one of them
    for flag, why in NO_EFFECT.items():
        lines = [line for line in launch_script_server.lines if f"{flag} has no effect: {why}" in line]
        assert len(lines) == 1, (flag, launch_script_server.log)


def test_id_names_the_server(launch_script_server: QuiverServer) -> None:
    assert httpclient.InferenceServerClient(launch_script_server.url).get_server_metadata()["name"] == "triton-a"
    metadata = grpcclient.InferenceServerClient(launch_script_server.grpc_url).get_server_metadata()
    assert metadata.name == "triton-a"


def test_model_config_name_picks_the_custom_configuration(launch_script_server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(launch_script_server.url)
    assert client.get_model_config("simple")["max_batch_size"] == 4  # configs/h100.pbtxt
    assert client.get_model_config("echo")["max_batch_size"] == 0  # no configs/: config.pbtxt


def test_disable_auto_complete_config_needs_a_config(launch_script_server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(launch_script_server.url)
    index = {entry["name"]: entry for entry in client.get_model_repository_index()}
    assert index["no_config"]["state"] == "UNAVAILABLE"
    assert index["simple"]["state"] == "READY"


def test_model_load_retry_count_retries_a_failed_load(launch_script_server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(launch_script_server.url)
    assert client.is_model_ready("flaky")
    assert any("retry 1 of 1 (--model-load-retry-count)" in line for line in launch_script_server.lines)


def test_strict_readiness_with_a_model_that_failed(launch_script_server: QuiverServer) -> None:
    # no_config failed (auto-complete disabled): strict readiness says the server is not ready
    response = requests.get(f"{launch_script_server.http}/v2/health/ready", timeout=30)
    assert response.status_code == 503
    assert not grpcclient.InferenceServerClient(launch_script_server.grpc_url).is_server_ready()
    assert httpclient.InferenceServerClient(launch_script_server.url).is_server_live()


def test_log_warning_and_error_flags_reach_the_logging_settings(launch_script_server: QuiverServer) -> None:
    settings = requests.get(f"{launch_script_server.http}/v2/logging", timeout=30).json()
    assert settings["log_warning"] is False
    assert settings["log_error"] is True


def _echo_parameters(result: object) -> dict[str, object]:
    value = result.as_numpy("PARAMETERS")[0]  # type: ignore[attr-defined]
    return json.loads(value.decode() if isinstance(value, bytes) else value)  # type: ignore[no-any-return]


def test_http_headers_matching_the_pattern_reach_the_model(launch_script_server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(launch_script_server.url)
    tensor = httpclient.InferInput("INPUT0", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    result = client.infer("echo", [tensor], headers={"x-app-user": "alice", "x-other": "no"})
    parameters = _echo_parameters(result)
    assert parameters["x-app-user"] == "alice"
    assert "x-other" not in parameters
    # plain HTTP too
    body = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [1]}]}
    response = requests.post(
        f"{launch_script_server.http}/v2/models/echo/infer", json=body, headers={"X-APP-Tenant": "t1"}, timeout=30
    )
    assert json.loads(response.json()["outputs"][0]["data"][0])["x-app-tenant"] == "t1"


def test_grpc_metadata_matching_the_pattern_reaches_the_model(launch_script_server: QuiverServer) -> None:
    client = grpcclient.InferenceServerClient(launch_script_server.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    result = client.infer("echo", [tensor], headers={"x-app-user": "bob", "x-other": "no"})
    parameters = _echo_parameters(result)
    assert parameters["x-app-user"] == "bob"
    assert "x-other" not in parameters


def test_a_forwarded_header_may_not_take_a_reserved_name(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    write_python(repo, "echo", ECHO_PARAMETERS, ECHO_CONFIG)
    with QuiverServer(repo, args=("--http-header-forward-pattern=.*",)) as running:
        body = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [1]}]}
        response = requests.post(
            f"{running.http}/v2/models/echo/infer", json=body, headers={"priority": "1"}, timeout=30
        )
        assert response.status_code == 400
        assert response.json()["error"] == "Header 'priority' is reserved for Triton usage and cannot be forwarded."
        # ready: no model failed (strict readiness is the default)
        assert requests.get(f"{running.http}/v2/health/ready", timeout=30).status_code == 200


def _quiver(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "quiver", "serve", *args], capture_output=True, text=True, timeout=60
    )


def test_bad_flag_values_stop_the_start_with_exit_code_2(tmp_path: Path) -> None:
    for args, message in (
        (["--http-header-forward-pattern=("], "--http-header-forward-pattern: '(' is not a regular expression"),
        (["--grpc-use-ssl=true"], "--grpc-server-cert is needed with --grpc-use-ssl"),
        (["--model-load-retry-count=-1"], "--model-load-retry-count must be at least 0"),
    ):
        done = _quiver("--model-repository", str(tmp_path), *args)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr


def _self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "server.crt", folder / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


@pytest.mark.parametrize("workers", ["0", "2"])  # in the process, in frontend workers
def test_grpc_over_tls(tmp_path: Path, workers: str) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    write_onnx(repo, "simple", simple_onnx(), SIMPLE_CONFIG)
    cert, key = _self_signed(tmp_path)
    with QuiverServer(
        repo,
        args=("--grpc-use-ssl=true", f"--grpc-server-cert={cert}", f"--grpc-server-key={key}", f"--frontend-workers={workers}"),
    ) as running:
        url = f"localhost:{running.grpc_port}"
        secure = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(cert))
        assert secure.is_model_ready("simple")
        plain = grpcclient.InferenceServerClient(url)
        with pytest.raises(InferenceServerException):
            plain.is_server_live(client_timeout=5)


def test_on_demand_readiness_does_not_follow_what_clients_ask_for(tmp_path: Path) -> None:
    repo = _repository(tmp_path, broken=True)
    with QuiverServer(repo, args=("--model-control-mode=on_demand",)) as running:
        client = httpclient.InferenceServerClient(running.url)
        tensor = httpclient.InferInput("X", [1], "FP32")
        tensor.set_data_from_numpy(np.ones(1, dtype=np.float32))
        with pytest.raises(InferenceServerException):
            client.infer("broken", [tensor])  # loads on demand, and fails
        index = {e["name"]: e for e in client.get_model_repository_index()}
        assert index["broken"]["state"] == "UNAVAILABLE"
        assert client.is_server_ready()  # strict readiness, but on demand: still in rotation
