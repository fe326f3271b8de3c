"""BLS with decoupled models: ``request.exec(decoupled=True)`` and its ``async_exec`` twin.

Both give an iterator of ``pb_utils.InferenceResponse``: each response the called model
sends, in order; a decoupled model's flag-only final shows as an empty last response, as in
Triton. ``cancel()`` cancels the call: the called model sees ``is_cancelled()``. A finished
iterator may be iterated again from the start. The request runs through the server's
streaming entry (:meth:`quiver.service.InferenceService.infer_stream`) on its event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any

import triton_python_backend_utils as pb_utils
from quiver.backends.base import SERVER
from quiver.backends.python_convert import _pb_error, _pb_response
from quiver.backends.python_sender import ResponseIterator
from quiver.errors import ErrorCode, QuiverError
from quiver.streaming import Cancellation, StreamResponse
from quiver.types import InferenceRequest

#: ``_Bls._submit``: runs a coroutine for the request on the server's loop.
Submit = Callable[
    [pb_utils.InferenceRequest, Callable[[InferenceRequest], Coroutine[Any, Any, Any]]],
    concurrent.futures.Future[Any],
]


def not_decoupled_call(model: str) -> str:
    """Triton's message for ``exec()`` (not decoupled) on a decoupled model."""
    return (
        f"Model {model} is using the decoupled. The current BLS request call doesn't support "
        "models using the decoupled transaction policy. Please use 'decoupled=True' argument to "
        "the 'exec' or 'async_exec' calls for decoupled models.'"
    )


def _pb(item: StreamResponse) -> pb_utils.InferenceResponse:
    if item.error is not None:
        return _pb_error(item.error.code, item.error.message)
    if item.response is None:
        return pb_utils.InferenceResponse([])
    return _pb_response(item.response)


def _start(request: pb_utils.InferenceRequest, submit: Submit) -> ResponseIterator:
    infer_stream = SERVER.infer_stream
    if infer_stream is None:
        raise pb_utils.TritonModelException("BLS requests can only run inside a running Quiver server")
    cancellation = Cancellation()
    iterator = ResponseIterator(cancellation.cancel)

    async def run(quiver_request: InferenceRequest) -> None:
        quiver_request.cancellation = cancellation
        try:
            async for item in infer_stream(quiver_request):
                iterator._put(_pb(item), item.final)
        except QuiverError as exc:
            iterator._put(_pb_error(exc.code, exc.message), True)
        except asyncio.CancelledError:
            iterator._put(_pb_error(ErrorCode.CANCELLED, "the BLS request was cancelled"), True)
            raise
        except Exception as exc:  # pragma: no cover - a bug on the server side
            iterator._put(_pb_error(ErrorCode.INTERNAL, f"BLS request failed: {exc!r}"), True)

    submit(request, run)
    return iterator


def exec_decoupled(request: pb_utils.InferenceRequest, submit: Submit) -> ResponseIterator:
    return _start(request, submit)


async def _first(iterator: ResponseIterator) -> ResponseIterator:
    await asyncio.wrap_future(iterator.first)
    return iterator


def async_exec_decoupled(request: pb_utils.InferenceRequest, submit: Submit) -> Coroutine[Any, Any, ResponseIterator]:
    """Resolves once the first response arrived, as Triton's does."""
    return _first(_start(request, submit))


__all__ = ["ResponseIterator", "async_exec_decoupled", "exec_decoupled", "not_decoupled_call"]
