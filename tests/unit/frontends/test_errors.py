"""Errors become statuses once per transport (frontends/status.py and its callers)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest
from starlette.testclient import TestClient
from tritonclient.grpc import service_pb2 as pb

from quiver.errors import NotFoundError, UnavailableError
from quiver.frontends.grpc import InferenceServicer
from quiver.frontends.grpc_stream import serve_stream
from quiver.frontends.http import HttpFrontend
from quiver.frontends.status import BodyTooLarge, grpc_error, http_error


def test_http_error_uses_the_table_and_413_for_large_bodies() -> None:
    assert http_error(NotFoundError("no model 'm'"), where="x") == (404, "no model 'm'")
    assert http_error(UnavailableError("loading"), where="x") == (503, "loading")
    assert http_error(BodyTooLarge(10), where="x")[0] == 413
    assert http_error(UnavailableError("full"), where="x", status_of=lambda exc: 507) == (507, "full")


def test_unexpected_errors_are_logged_once_and_name_the_model(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="quiver.frontends.status"):
        status, message = http_error(ZeroDivisionError("boom"), model="m", where="POST /x")
    assert (status, message) == (500, "internal error in model 'm': ZeroDivisionError: boom")
    assert [r.getMessage() for r in caplog.records] == ["POST /x failed unexpectedly"]
    assert caplog.records[0].exc_info is not None
    code, message = grpc_error(KeyError("k"), where="gRPC X")
    assert (code, message) == (grpc.StatusCode.INTERNAL, "internal error: KeyError: 'k'")
    assert grpc_error(NotFoundError("gone"), where="x") == (grpc.StatusCode.NOT_FOUND, "gone")


class _Service:
    ready = True

    def start_trace(self, model: str, headers: Any = None) -> None:
        return None  # not traced

    def model_metadata(self, name: str, version: str) -> dict[str, Any]:
        raise NotFoundError(f"unknown model: '{name}'")

    def model_config(self, name: str, version: str) -> dict[str, Any]:
        raise ZeroDivisionError("boom")

    def model_statistics(self, name: str, version: str) -> dict[str, Any]:
        raise ZeroDivisionError("boom")


def test_http_routes_translate_through_one_handler(caplog: pytest.LogCaptureFixture) -> None:
    client = TestClient(HttpFrontend(_Service()).app())  # type: ignore[arg-type]
    response = client.get("/v2/models/m")
    assert (response.status_code, response.json()) == (404, {"error": "unknown model: 'm'"})
    with caplog.at_level(logging.ERROR):
        response = client.get("/v2/models/m/config")
    assert response.status_code == 500
    assert response.json() == {"error": "internal error in model 'm': ZeroDivisionError: boom"}
    assert len(caplog.records) == 1  # Starlette raises it again; it is not logged twice


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.status = (code, message)
        raise _Aborted


def test_grpc_unary_errors_abort_with_the_table_status(caplog: pytest.LogCaptureFixture) -> None:
    servicer = InferenceServicer(_Service())  # type: ignore[arg-type]

    async def call(method: Any, request: Any) -> tuple[grpc.StatusCode, str] | None:
        context = _Context()
        with pytest.raises(_Aborted):
            await method(request, context)
        return context.status

    request = pb.ModelMetadataRequest(name="m")
    assert asyncio.run(call(servicer.ModelMetadata, request)) == (
        grpc.StatusCode.NOT_FOUND,
        "unknown model: 'm'",
    )
    with caplog.at_level(logging.ERROR):
        status = asyncio.run(call(servicer.ModelStatistics, pb.ModelStatisticsRequest(name="m")))
    assert status == (grpc.StatusCode.INTERNAL, "internal error in model 'm': ZeroDivisionError: boom")
    assert [r.getMessage() for r in caplog.records] == [
        "gRPC ModelStatistics on model 'm' failed unexpectedly"
    ]


def test_a_failed_stream_request_is_an_error_message_with_its_id() -> None:
    servicer = InferenceServicer(_Service())  # type: ignore[arg-type]
    data = pb.ModelInferRequest(model_name="m", id="r1").SerializeToString()

    async def infer_stream(request: Any) -> Any:
        raise UnavailableError("model 'm' is loading")
        yield  # an async generator, as the service's

    async def open_stream(request: Any) -> Any:
        return False, infer_stream(request)  # not decoupled, as InferenceService.open_stream answers

    servicer.service.open_stream = open_stream  # type: ignore[attr-defined]

    async def requests() -> Any:
        yield data
        yield b"\xff\xff"

    async def run() -> list[bytes]:
        return [message async for message in serve_stream(servicer, requests())]

    answer, garbage = (pb.ModelStreamInferResponse.FromString(m) for m in asyncio.run(run()))
    assert answer.error_message == "model 'm' is loading"
    assert answer.infer_response.id == "r1"
    assert answer.infer_response.parameters["triton_final_response"].bool_param
    assert garbage.error_message.startswith("malformed ModelInferRequest message")
