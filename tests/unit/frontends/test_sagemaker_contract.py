"""SageMaker frontend pieces without a server: settings, port range, content types, 507."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

import pytest

from quiver.errors import InvalidArgumentError, NotFoundError, QuiverError, UnavailableError
from quiver.frontends.sagemaker import (
    BINARY_JSON_PREFIX,
    SageMakerFrontend,
    SageMakerSettings,
    check_port,
    enabled_by_env,
    error_status,
    header_length_from_content_type,
    parse_port_range,
)
from quiver.lifecycle import ModelRepositoryManager
from quiver.service import CacheFullError, InferenceService, OutOfMemoryError


def test_settings_from_env() -> None:
    assert SageMakerSettings.from_env({}) == SageMakerSettings(False, "", "ready")
    settings = SageMakerSettings.from_env(
        {"SAGEMAKER_MULTI_MODEL": "TRUE", "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "m", "SAGEMAKER_TRITON_PING_MODE": "live"}
    )
    assert settings == SageMakerSettings(True, "m", "live")
    assert not SageMakerSettings.from_env({"SAGEMAKER_MULTI_MODEL": "false"}).multi_model
    with pytest.raises(InvalidArgumentError, match="SAGEMAKER_TRITON_PING_MODE"):
        SageMakerSettings.from_env({"SAGEMAKER_TRITON_PING_MODE": "sometimes"})


def test_enabled_by_env() -> None:
    assert not enabled_by_env({"PATH": "/bin", "SAGEMAKER_BIND_TO_PORT": "8080"})
    assert enabled_by_env({"SAGEMAKER_MULTI_MODEL": "false"})
    assert enabled_by_env({"SAGEMAKER_TRITON_LOG_VERBOSE": "1"})


def test_safe_port_range() -> None:
    assert parse_port_range(" 8000-8999 ") == (8000, 8999)
    for bad in ("8000", "9-x", "9000-8000", "0-10", "1-70000"):
        with pytest.raises(InvalidArgumentError):
            parse_port_range(bad)
    check_port(8080, (8000, 8999))
    check_port(0, (8000, 8999))  # a free port inside the range is picked
    check_port(1, None)
    with pytest.raises(InvalidArgumentError, match="outside the safe port range 8000-8999"):
        check_port(9000, (8000, 8999))


def test_header_length_from_content_type() -> None:
    assert header_length_from_content_type("application/json", 10) is None
    assert header_length_from_content_type(BINARY_JSON_PREFIX + "4", 10) == 4
    assert header_length_from_content_type("application/vnd.sagemaker-triton.binary+json; json-header-size=0", 3) == 0
    for bad in (BINARY_JSON_PREFIX + "11", BINARY_JSON_PREFIX + "-1", BINARY_JSON_PREFIX, "application/vnd.sagemaker-triton.binary+json"):
        with pytest.raises(InvalidArgumentError):
            header_length_from_content_type(bad, 10)
    with pytest.raises(InvalidArgumentError, match="start with"):
        header_length_from_content_type("text/plain;" + BINARY_JSON_PREFIX + "4", 10)


def test_capacity_errors_are_507_others_follow_the_table() -> None:
    assert error_status(OutOfMemoryError("no room")) == 507
    assert error_status(CacheFullError("disk full")) == 507
    assert error_status(UnavailableError("loading")) == 503
    assert error_status(NotFoundError("ghost")) == 404
    assert error_status(InvalidArgumentError("bad")) == 400


class _Manager:
    """Just what the service's SageMaker load touches; load raises what the test gives it."""

    def __init__(self, error: QuiverError) -> None:
        self.error = error
        self.ready_models: list[Any] = []
        self.on_demand = False

    def bind(self, infer: Any) -> None:
        pass

    def request_came(self) -> None:
        pass

    def is_ready(self, name: str, version: str = "") -> bool:
        return False

    async def load(self, name: str, config_json: str | None = None, files: Any = None) -> None:
        raise self.error


async def _post(app: SageMakerFrontend, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    payload = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": payload, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json")], "query_string": b""}
    await app(scope, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"])


@pytest.mark.parametrize("error", [OutOfMemoryError("model 'm' needs 2 GB, 1 GB free"), CacheFullError("cache is full")])
def test_load_that_does_not_fit_is_507(tmp_path: Path, error: QuiverError) -> None:
    model = tmp_path / "m"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text("")
    service = InferenceService(cast(ModelRepositoryManager, _Manager(error)), repositories=[tmp_path])
    app = SageMakerFrontend(service)
    status, body = asyncio.run(_post(app, "/models", {"model_name": "h", "url": str(model)}))
    assert status == 507
    assert body == {"error": error.message}
    assert "h" not in app.registered
