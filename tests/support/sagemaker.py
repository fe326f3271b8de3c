"""Play the SageMaker platform: start Quiver through its container entrypoint
(``quiver sagemaker-serve``) and extract model archives as the platform does."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from support.server import QuiverServer


class EntrypointServer(QuiverServer):
    """``python -m quiver sagemaker-serve`` with ``env`` (the SAGEMAKER_* variables) on a
    free SageMaker port; ``model_root`` is single-model mode's /opt/ml/model and
    ``multi_model_repository`` multi-model mode's empty repository."""

    def __init__(
        self,
        model_root: Path,
        multi_model_repository: Path,
        *,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> None:
        env = {"SAGEMAKER_BIND_TO_PORT": "0", "SAGEMAKER_TRITON_LOG_VERBOSE": "false", **(env or {})}
        super().__init__(sagemaker=True, env=env, timeout=timeout)
        self.model_root = model_root
        self.multi_model_repository = multi_model_repository

    def command(self) -> list[str]:
        return entrypoint_command(self.model_root, self.multi_model_repository)

    def _disabled(self, flag: str) -> bool:
        # The entrypoint turns HTTP off, and gRPC unless SAGEMAKER_TRITON_ALLOW_GRPC is true.
        if flag == "--allow-grpc":
            return self.env.get("SAGEMAKER_TRITON_ALLOW_GRPC", "false").lower() != "true"
        return flag == "--allow-http"


def entrypoint_command(model_root: Path, multi_model_repository: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "quiver",
        "sagemaker-serve",
        "--model-root",
        str(model_root),
        "--multi-model-repository",
        str(multi_model_repository),
    ]


def run_entrypoint(
    model_root: Path, multi_model_repository: Path, env: dict[str, str], *extra: str, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """Run the entrypoint to completion (start-up failures, ``--print-command``)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SAGEMAKER_")}
    environ.update(env)
    return subprocess.run(
        [*entrypoint_command(model_root, multi_model_repository), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
    )


def platform_extract(archive: bytes, models_root: Path, model_hash: str) -> Path:
    """What the platform does before ``POST /models``: extract the TargetModel's archive to
    ``<models_root>/<hash>/model``; returns that folder (the ``url``)."""
    folder = models_root / model_hash / "model"
    folder.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        tar.extractall(folder, filter="data")
    return folder
