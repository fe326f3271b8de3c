"""The SageMaker image (``Dockerfile``): built and run as SageMaker runs it (``docker run IMAGE
serve``, the model at /opt/ml/model or the platform's folders under /opt/ml/models, port
8080), when a container engine answers on this machine; skipped, saying why, otherwise."""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_sagemaker import TARGET, call, invoke, outputs

from support.archives import pipeline_archive

ROOT = Path(__file__).resolve().parents[2]
X = np.arange(8, dtype=np.float32).reshape(2, 4)


def _engine() -> tuple[str | None, str]:
    """A container engine that answers, or None and why not."""
    found = [name for name in ("docker", "podman") if shutil.which(name)]
    if not found:
        return None, "no container engine (docker or podman) on this machine"
    reasons = []
    for name in found:
        try:
            info = subprocess.run([name, "info"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            reasons.append(f"{name} info failed: {exc}")
            continue
        if info.returncode == 0:
            return name, ""
        last = (info.stderr.strip().splitlines() or ["no output"])[-1]
        reasons.append(f"'{name} info' exited {info.returncode}: {last}")
    return None, "; ".join(reasons)


ENGINE, WHY_NOT = _engine()
pytestmark = [
    pytest.mark.skipif(ENGINE is None, reason=f"the image cannot be built here: {WHY_NOT}"),
    pytest.mark.timeout(1800),
]


def engine(*args: str, timeout: float = 1500) -> str:
    assert ENGINE is not None
    result = subprocess.run([ENGINE, *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{ENGINE} {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout.strip()


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    tag = f"quiver-sagemaker-test:{uuid.uuid4().hex[:8]}"
    # The smallest image (ONNX Runtime and Python backends): the build is what is tested.
    engine("build", "--build-arg", "QUIVER_EXTRAS=", "-t", tag, str(ROOT))
    try:
        yield tag
    finally:
        subprocess.run([ENGINE or "docker", "rmi", "-f", tag], capture_output=True, timeout=120)


def run_container(image: str, mounts: dict[Path, str], env: dict[str, str]) -> tuple[str, str]:
    """Start ``IMAGE serve``; returns (container id, base url) once /ping answers."""
    args = ["run", "-d", "-p", "127.0.0.1::8080"]
    for source, target in mounts.items():
        args += ["-v", f"{source}:{target}:ro"]
    for key, value in env.items():
        args += ["-e", f"{key}={value}"]
    container = engine(*args, image, "serve", timeout=120)
    port = engine("port", container, "8080/tcp", timeout=30).splitlines()[0].rsplit(":", 1)[1]
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if call(base, "GET", "/ping").status == 200:
                return container, base
        except OSError:
            pass
        time.sleep(0.5)
    logs = subprocess.run([ENGINE or "docker", "logs", container], capture_output=True, text=True, timeout=30)
    subprocess.run([ENGINE or "docker", "rm", "-f", container], capture_output=True, timeout=60)
    raise AssertionError(f"the container did not answer /ping:\n{logs.stdout}\n{logs.stderr}")


def extract(archive: bytes, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        tar.extractall(into, filter="data")
    return into


def test_single_model_endpoint_in_the_image(image: str, tmp_path: Path) -> None:
    root = extract(pipeline_archive(5.0), tmp_path / "model")
    root.chmod(0o755)
    container, base = run_container(image, {root: "/opt/ml/model"}, {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "pipe"})
    try:
        np.testing.assert_array_equal(outputs(invoke(base, "/invocations", X))["OUT"], X + 105)
    finally:
        engine("rm", "-f", container, timeout=60)


def test_multi_model_endpoint_in_the_image(image: str, tmp_path: Path) -> None:
    models = tmp_path / "models"
    name = hashlib.sha256(b"pipe.tar.gz").hexdigest()[:32]
    extract(pipeline_archive(2.0), models / name / "model")
    container, base = run_container(image, {models: "/opt/ml/models"}, {"SAGEMAKER_MULTI_MODEL": "true"})
    try:
        body = {"model_name": name, "url": f"/opt/ml/models/{name}/model"}
        load = call(base, "POST", "/models", body, {TARGET: "pipe.tar.gz"})
        assert load.status == 200, load.body
        np.testing.assert_array_equal(outputs(invoke(base, f"/models/{name}/invoke", X))["OUT"], X + 102)
        assert call(base, "DELETE", f"/models/{name}").status == 200
    finally:
        engine("rm", "-f", container, timeout=60)
