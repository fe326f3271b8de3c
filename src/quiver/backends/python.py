"""Triton's Python backend: runs a model's ``model.py`` unchanged, by default in a worker
process per instance (:mod:`quiver.backends.python_worker`), or in the server's process, which
this module's :class:`PythonInstance` does.

Each instance imports the version folder's model file as a fresh module (a private
package per instance, so two models whose files are both ``model.py`` do not share
state), builds ``TritonPythonModel`` and calls ``initialize(args)``. Every call into the
model (import, ``initialize``, ``execute``, ``finalize``) runs on the instance's own
thread, which owns an asyncio event loop for models whose methods are ``async def``.

Response senders, background async execute and ``is_ready()``: ``python_decoupled``;
importing ``model.py``: ``python_loading``; conversions: ``python_convert``; this module
keeps the instance (threads, event-loop inlining), the backend and BLS. No GPU tensors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import os
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as pb

import triton_python_backend_utils as pb_utils
from quiver.backends import python_bls_stream, python_env
from quiver.backends.base import (
    SERVER,
    ExecuteResult,
    InstanceSpec,
    ModelFiles,
    ThreadedInstance,
    format_exception,
)
from quiver.backends.python_convert import (
    _error_code,
    _json_ready,
    _model_error,
    _pb_error,
    _pb_response,
    _quiver_request,
    _request_fields,
    model_response,
)
from quiver.backends.python_decoupled import (
    DecoupledInstance,
    Senders,
    cancelled,
    resolve,
)
from quiver.backends.python_env import PythonEnv
from quiver.backends.python_loading import _import_model_file, _LoadedModule, _model_class
from quiver.backends.python_process import start_worker
from quiver.backends.python_readiness import UserReadiness
from quiver.backends.python_sender import BackgroundLoop, ResponseIterator
from quiver.backends.python_settings import (
    IN_PROCESS_PARAMETER,
    PythonSettings,
    parse_bool,
    parse_python_settings,
)
from quiver.backends.python_worker import WorkerInstance
from quiver.config import ModelConfig, config_to_json
from quiver.errors import (
    ConfigError,
    ErrorCode,
    InternalError,
    QuiverError,
    UnsupportedError,
    error_for_code,
)
from quiver.types import InferenceRequest, InferenceResponse

logger = logging.getLogger(__name__)

#: Executions a Python model runs on its own thread, with no BLS call and no exception, before
#: it may run on the event loop (when it is also fast: ``ThreadedInstance``'s threshold).
INLINE_AFTER_EXECUTIONS = 64
#: The model config parameter by which a Python model opts in to running on the event loop.
INLINE_PARAMETER = "EXECUTE_ON_EVENT_LOOP"


class _RunOnThread(BaseException):
    """An execution on the event loop that must run on the model's thread instead (it called
    BLS, raised, or returned a coroutine). A BaseException, so ``except Exception`` in a model
    does not catch it."""


#: The Python instance whose ``execute`` runs on the current thread (for BLS to find it).
_current = threading.local()
#: Instances whose ``execute`` is running on their own threads now, and the one running on the
#: event loop (at most one: there is one loop): a BLS call from a thread a model started itself
#: names no instance, so these are the candidates.
_on_threads: set[PythonInstance] = set()
_on_loop: list[PythonInstance] = []


# ------------------------------------------------------------------------ instance


def _initialize_args(config: ModelConfig, files: ModelFiles, spec: InstanceSpec) -> dict[str, str]:
    """``initialize(args)``: what Triton hands a Python model."""
    return {
        "model_config": json.dumps(config_to_json(config.proto)),
        "model_instance_kind": spec.group.kind.removeprefix("KIND_"),
        "model_instance_name": spec.name,
        "model_instance_device_id": str(spec.device_id),
        "model_repository": str(files.model_dir),
        "model_version": str(files.version),
        "model_name": config.name,
    }


class PythonInstance(DecoupledInstance, ThreadedInstance):
    """One ``TritonPythonModel`` object, driven on its own thread.

    A model that opts in (config parameter ``EXECUTE_ON_EVENT_LOOP: "true"``) and whose
    ``execute`` is short runs on the event loop instead, as small ONNX models do, which saves
    the two thread wake-ups per call, most of a tiny model's cost. It is opt-in because user
    code may wait for the server itself (a request to this server over HTTP from ``execute``),
    which on the loop would wait forever. Even then a model moves only when that cannot change
    what it sees: after ``INLINE_AFTER_EXECUTIONS`` executions on its own thread that called
    no BLS and raised nothing, if ``execute`` is not a coroutine function and the model has no
    sequence batcher. A model that calls BLS never moves. An execution on the loop that calls
    BLS (from any thread), raises, or returns a coroutine is abandoned at that point and run
    again on the model's thread, which it then never leaves.
    """

    def __init__(self, config: ModelConfig, files: ModelFiles, spec: InstanceSpec) -> None:
        super().__init__(spec.name)
        self._config = config
        self._files = files
        self._spec = spec
        self._where = f"model '{config.name}' version {files.version}"
        self._version = str(files.version)
        self._all_outputs = [tensor.name for tensor in config.outputs]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loaded: _LoadedModule | None = None
        self._model: Any = None
        self._clean_executions = 0  # on the thread, with no BLS call and no exception
        self._may_inline = False  # set after load: a plain (not async) execute
        self._inlining = False  # an execution is running on the event loop now
        self._decoupled = bool(config.proto.model_transaction_policy.decoupled)
        self._background: BackgroundLoop | None = None  # a decoupled model's async execute
        self._readiness: UserReadiness | None = None  # the model's own is_ready(), if any
        self._open_streams = weakref.WeakSet()

    # ---- load / unload (instance thread)

    def _load(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            path = self._files.version_dir / self._config.default_model_filename
            self._loaded = _import_model_file(path, self._files, self._where, self._config.name)
            cls = _model_class(self._loaded, path, self._where)
            try:
                self._model = cls()
            except (Exception, SystemExit) as exc:
                raise _model_error(
                    exc,
                    f"{self._where}: creating TritonPythonModel failed: {format_exception(exc)}",
                ) from exc
            initialize = getattr(self._model, "initialize", None)
            if initialize is not None:
                try:
                    result = initialize(self._initialize_args())
                    if inspect.isawaitable(result):
                        loop.run_until_complete(result)
                except (Exception, SystemExit) as exc:
                    raise _model_error(
                        exc, f"{self._where}: initialize() failed: {format_exception(exc)}"
                    ) from exc
            self._watch_readiness(self._model)
            self._may_inline = (
                self._config.parameters.get(INLINE_PARAMETER, "").strip().lower() == "true"
                and not self._config.proto.HasField("sequence_batching")
                and not self._decoupled
                and not inspect.iscoroutinefunction(getattr(self._model, "execute", None))
            )
        except BaseException:
            self._close()
            raise

    def _initialize_args(self) -> dict[str, str]:
        return _initialize_args(self._config, self._files, self._spec)

    def release(self) -> None:
        self._end_streams()
        if self._background is not None:
            self._background.stop()
            self._background = None
        try:
            finalize = getattr(self._model, "finalize", None) if self._model is not None else None
            if finalize is not None:
                try:
                    result = finalize()
                    if inspect.isawaitable(result) and self._loop is not None:
                        self._loop.run_until_complete(result)
                except (Exception, SystemExit) as exc:
                    logger.error("%s: finalize() failed: %s", self._where, format_exception(exc))
        finally:
            self._close()

    def _close(self) -> None:
        self._model = None
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            try:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
            except Exception as exc:  # pragma: no cover - defensive
                logger.warning("%s: closing the event loop: %s", self._where, exc)
            finally:
                loop.close()
                asyncio.set_event_loop(None)
        if self._loaded is not None:
            self._loaded.forget()
            self._loaded = None

    # ---- execute (instance thread)

    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        count = len(requests)
        timing = self.timing
        t0 = time.monotonic_ns()
        senders = Senders(requests, self._decoupled, self._converter(requests))
        self._track_streams(requests)
        try:
            pb_requests = [
                self._pb_request(request, senders.factory(index)) for index, request in enumerate(requests)
            ]
        except Exception as exc:
            return self._fail_all(
                count,
                ErrorCode.INTERNAL,
                f"{self._where}: preparing the requests failed: {format_exception(exc)}",
            )
        model_execute = getattr(self._model, "execute", None)
        if model_execute is None:
            return self._fail_all(
                count,
                ErrorCode.INTERNAL,
                f"{self._where}: TritonPythonModel does not implement 'execute'",
            )
        t1 = time.monotonic_ns()
        inlining = self._inlining
        _current.instance = self
        if not inlining:
            _on_threads.add(self)
        try:
            result = model_execute(pb_requests)
            if inspect.isawaitable(result):
                if inlining:
                    if inspect.iscoroutine(result):
                        result.close()
                    raise _RunOnThread("execute() returned an awaitable")
                if self._decoupled and inspect.iscoroutine(result):
                    self._in_background(result, senders)
                    result = None
                else:
                    assert self._loop is not None
                    result = self._loop.run_until_complete(result)
        except (Exception, SystemExit) as exc:
            if inlining:
                raise _RunOnThread(f"execute() raised {type(exc).__name__}") from exc
            self._clean_executions = 0
            senders.close()
            return self._fail_all(
                count,
                _error_code(exc),
                f"{self._where}: execute() raised {format_exception(exc)}",
            )
        finally:
            _current.instance = None
            _on_threads.discard(self)
        if not inlining and self._may_inline:
            self._clean_executions += 1
        t2 = time.monotonic_ns()
        if self._decoupled or senders.used:
            responses = senders.results(result, self._config.name, self._responses)
        else:
            responses = self._responses(result, requests)
        timing.input_ns = t1 - t0
        timing.infer_ns = t2 - t1
        timing.output_ns = time.monotonic_ns() - t2
        return responses

    @property
    def runs_inline(self) -> bool:
        return (
            self._may_inline
            and self._clean_executions >= INLINE_AFTER_EXECUTIONS
            and 0 <= self._cost_ns < self.inline_threshold_ns
        )

    @property
    def answers_at_once(self) -> bool:
        return False  # an inline call may still move to the thread (``_RunOnThread``) and wait

    def used_bls(self) -> None:
        """BLS was called from this instance's ``execute``: it stays on its thread."""
        self._may_inline = False

    async def run(self, requests: list[InferenceRequest]) -> ExecuteResult:
        if self.runs_inline:
            self._inlining = True
            _on_loop.append(self)
            try:
                return self._timed(requests)
            except _RunOnThread as exc:
                self._may_inline = False
                logger.info("%s runs on its own thread from now on: %s on the event loop", self._where, exc)
            finally:
                self._inlining = False
                _on_loop.remove(self)
        return await resolve(await super().run(requests))

    @staticmethod
    def _fail_all(count: int, code: ErrorCode, message: str) -> ExecuteResult:
        return [error_for_code(code, message) for _ in range(count)]

    def _pb_request(
        self, request: InferenceRequest, sender_factory: Callable[[], Any]
    ) -> pb_utils.InferenceRequest:
        inputs = []
        for tensor in request.inputs:
            array = tensor.data
            if tuple(array.shape) != tuple(tensor.shape):
                array = array.reshape(tensor.shape)
            inputs.append(pb_utils.Tensor._wrap(tensor.name, array, tensor.datatype.triton_value))
        fields = _request_fields(request, self._all_outputs)
        fields["requested_output_names"] = set(fields["requested_output_names"])
        fields["model_name"] = self._config.name
        pb_request = pb_utils.InferenceRequest._from_server(
            inputs=inputs,
            model_version=int(self._files.version),
            sender_factory=sender_factory,
            cancelled=cancelled(request),
            **fields,
        )
        pb_request.trace()._server = request.trace  # BLS requests given trace= are traced with it
        return pb_request

    def _responses(self, result: Any, requests: list[InferenceRequest]) -> ExecuteResult:
        count = len(requests)
        expected = (
            f"a model that is not decoupled must return a list with one "
            f"pb_utils.InferenceResponse per request ({count} requests)"
        )
        if result is None:
            return self._fail_all(
                count, ErrorCode.INTERNAL, f"{self._where}: execute() returned None; {expected}"
            )
        if not isinstance(result, list):
            return self._fail_all(
                count,
                ErrorCode.INTERNAL,
                f"{self._where}: execute() returned a {type(result).__name__}; {expected}",
            )
        if len(result) != count:
            return self._fail_all(
                count,
                ErrorCode.INTERNAL,
                f"{self._where}: execute() returned {len(result)} responses for {count} "
                f"requests; {expected}",
            )
        return [
            self._response(item, request, index)
            for index, (item, request) in enumerate(zip(result, requests, strict=True))
        ]

    def _response(
        self, item: Any, request: InferenceRequest, index: int
    ) -> InferenceResponse | QuiverError:
        return model_response(item, self._where, self._config.name, self._version, request.id, index)


# ------------------------------------------------------------------------- backend


class PythonBackend:
    """Triton's Python backend: each instance in a worker process of its own
    (:mod:`quiver.backends.python_worker`), or in the server's process when the server
    (``--backend-config=python,in-process=true``) or the model (parameter
    ``QUIVER_PYTHON_IN_PROCESS``) says so."""

    name = "python"

    def __init__(self) -> None:
        self._settings: tuple[object, PythonSettings] | None = None

    def settings(self) -> PythonSettings:
        config = SERVER.backend_config.get("python", {})
        cached = self._settings
        if cached is None or cached[0] is not config:
            try:
                cached = (config, parse_python_settings(config))
            except QuiverError as exc:
                raise ConfigError(exc.message) from None
            self._settings = cached
        return cached[1]

    def in_process(self, parameters: dict[str, str], name: str) -> bool:
        value = parameters.get(IN_PROCESS_PARAMETER, "").strip()
        if not value:
            return self.settings().in_process
        try:
            return parse_bool(value, f"model '{name}': parameter '{IN_PROCESS_PARAMETER}'")
        except QuiverError as exc:
            raise ConfigError(exc.message) from None

    @staticmethod
    def _cache_root() -> Path:
        if SERVER.cache_dir is not None:
            return SERVER.cache_dir
        return Path(tempfile.gettempdir()) / f"quiver-python-{os.getuid()}"

    def _environment(self, parameters: dict[str, str], name: str, model_dir: Path) -> tuple[PythonEnv, str]:
        """The model's Python and the folder its workers import Quiver's modules from."""
        env = python_env.resolve(parameters, name, model_dir, self._cache_root())
        if env is None:
            return PythonEnv(sys.executable), str(python_env.source_root())
        return env, str(python_env.worker_tree(self._cache_root()))

    def auto_complete(self, config: pb.ModelConfig, files: ModelFiles, strict: bool) -> None:
        """Call the model's ``auto_complete_config`` and use what it returns (in a short-lived
        worker, unless the model runs in-process).

        Triton skips this when auto-complete is disabled (``--strict-model-config=true``
        or ``--disable-auto-complete-config``); so does Quiver when ``strict``.
        """
        if strict:
            return
        name = config.name
        where = f"model '{name}' version {files.version}"
        parameters = {key: value.string_value for key, value in config.parameters.items()}
        if self.in_process(parameters, name):
            result = self._auto_complete_here(config, files, where)
        else:
            env, tree = self._environment(parameters, name, files.model_dir)
            model_config = ModelConfig.from_proto(config, "")
            worker, ready = start_worker(
                model_config, files, env, tree, self.settings(), None, auto_complete=config_to_json(config)
            )
            worker.kill()
            worker.close()
            result = ready.get("config")
        if result is None:
            return
        completed = pb.ModelConfig()
        try:
            json_format.ParseDict(_json_ready(result), completed)
        except (json_format.ParseError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"{where}: auto_complete_config() returned an invalid configuration: {exc}"
            ) from None
        completed.name = config.name
        completed.backend = config.backend
        config.CopyFrom(completed)

    @staticmethod
    def _auto_complete_here(config: pb.ModelConfig, files: ModelFiles, where: str) -> dict[str, Any] | None:
        filename = config.default_model_filename or "model.py"
        path = files.version_dir / filename
        loaded = _import_model_file(path, files, where, config.name)
        try:
            cls = _model_class(loaded, path, where)
            method = getattr(cls, "auto_complete_config", None)
            if method is None:
                return None
            model_config = pb_utils.ModelConfig(config_to_json(config))
            try:
                result = method(model_config)
            except Exception as exc:
                raise _model_error(
                    exc, f"{where}: auto_complete_config() failed: {format_exception(exc)}"
                ) from exc
            if not isinstance(result, pb_utils.ModelConfig):
                raise InternalError(
                    f"{where}: auto_complete_config() must return a pb_utils.ModelConfig "
                    f"object, got {type(result).__name__}"
                )
            return result.as_dict()
        finally:
            loaded.forget()

    def create_instance(
        self, config: ModelConfig, files: ModelFiles, spec: InstanceSpec
    ) -> PythonInstance | WorkerInstance:
        parameters = dict(config.parameters)
        if self.in_process(parameters, config.name):
            if parameters.get(python_env.ENV_PARAMETER, "").strip():
                raise ConfigError(
                    f"model '{config.name}': {python_env.ENV_PARAMETER} needs a worker process; "
                    f"it cannot run in the server's process ({IN_PROCESS_PARAMETER} or "
                    "--backend-config=python,in-process=true)"
                )
            instance = PythonInstance(config, files, spec)
            try:
                instance._executor.submit(instance._load).result()
            except BaseException:
                instance._executor.shutdown(wait=True)
                raise
            return instance
        env, tree = self._environment(parameters, config.name, files.model_dir)
        worker = WorkerInstance(config, files, spec, env, tree, self.settings(), _initialize_args(config, files, spec))
        worker.start()
        return worker


class _Bls:
    """BLS for Python models: ``pb_utils.InferenceRequest.exec()`` / ``async_exec()`` run the
    request through the server's inference path on its event loop, from the model's
    thread (exec) or the model's own event loop (async_exec)."""

    def _submit(
        self,
        request: pb_utils.InferenceRequest,
        on_server: Callable[[InferenceRequest], Coroutine[Any, Any, Any]] | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Run ``request`` on the server's loop (with ``on_server``, or as one inference)."""
        infer, loop = SERVER.infer, SERVER.loop
        if infer is None or loop is None or loop.is_closed():
            raise pb_utils.TritonModelException("BLS requests can only run inside a running Quiver server")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        instance: PythonInstance | None = getattr(_current, "instance", None)
        if instance is not None:
            instance.used_bls()
        else:
            # From a thread a model started: any model executing now may be the caller.
            for candidate in list(_on_threads):
                candidate.used_bls()
            if _on_loop:
                # The loop is busy in that model's execute and could never run this request.
                _on_loop[0].used_bls()
                raise _RunOnThread("execute() called BLS from another thread")
        if running is loop:
            if instance is not None and instance._inlining:
                raise _RunOnThread("execute() called BLS")
            raise pb_utils.TritonModelException(
                "BLS exec() would block the server's event loop; use 'await request.async_exec()'"
            )
        quiver_request = _quiver_request(request)

        async def run() -> InferenceResponse:
            decoupled = SERVER.decoupled
            if decoupled is not None and decoupled(quiver_request.model_name, quiver_request.model_version):
                raise UnsupportedError(python_bls_stream.not_decoupled_call(quiver_request.model_name))
            return await infer(quiver_request)

        return asyncio.run_coroutine_threadsafe(run() if on_server is None else on_server(quiver_request), loop)

    def exec(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        future = self._submit(request)
        timeout = request.timeout() / 1e6 if request.timeout() else None
        try:
            return _pb_response(future.result(timeout))
        except concurrent.futures.TimeoutError:
            future.cancel()
            return _pb_error(ErrorCode.UNAVAILABLE, f"BLS request to model '{request.model_name()}' timed out")
        except QuiverError as exc:
            return _pb_error(exc.code, exc.message)

    async def _await(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        try:
            return _pb_response(await asyncio.wrap_future(self._submit(request)))
        except QuiverError as exc:
            return _pb_error(exc.code, exc.message)

    def async_exec(self, request: pb_utils.InferenceRequest) -> Awaitable[pb_utils.InferenceResponse]:
        return self._await(request)

    def exec_decoupled(self, request: pb_utils.InferenceRequest) -> ResponseIterator:
        return python_bls_stream.exec_decoupled(request, self._submit)

    def async_exec_decoupled(self, request: pb_utils.InferenceRequest) -> Awaitable[ResponseIterator]:
        return python_bls_stream.async_exec_decoupled(request, self._submit)


pb_utils._set_bls_executor(_Bls())

BACKEND = PythonBackend()
