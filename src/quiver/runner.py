"""Assembly and ordered start/stop of one Quiver server process.

:func:`assemble` builds the parts one server is made of (model manager, inference service,
the v2 and SageMaker applications) from :class:`~quiver.settings.Settings`; the
single-process :class:`Runner` and the Ray replica (:mod:`quiver.rayserve.deployments`) both
use it, and :func:`load_models` for the models loaded at start.

:class:`Runner` starts in this order, each step on an ``AsyncExitStack``:

1. logging (``--log-*``);
2. the metrics registry and its collector (with ``--allow-metrics``);
3. the model manager and its disk cache;
4. the models loaded at start (``--exit-on-error`` makes a failed one a failed start);
5. the listeners: metrics, SageMaker, gRPC, HTTP (last, so "started HTTP service" means
   every listener is up; with ``--frontend-workers N``, N worker processes serve HTTP, gRPC
   and SageMaker, :mod:`quiver.frontends.workers`); then CloudWatch publishing (``--cloudwatch-*``, which
   stops after the listeners drained and before the models unload) and the server is ready.

A failure at any step closes exactly what the earlier steps opened, in reverse order, logs
why, and exits non-zero (2 for a logging set-up the flags make impossible, as for other flags;
1 otherwise). SIGINT/SIGTERM stop the server in the same reverse order: not ready, every
listener stops taking requests at once (gRPC health NOT_SERVING first) and the in-flight ones
finish, then the listeners close from HTTP to metrics, the manager drains every model's
scheduler and unloads the models (``finalize`` runs), the collector closes; exit 0.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.registry import CollectorRegistry

from quiver import logs
from quiver.backends.base import SERVER
from quiver.errors import InvalidArgumentError
from quiver.frontends.asgi import AsgiServer, serve
from quiver.frontends.grpc import GrpcFrontend
from quiver.frontends.grpc_worker import GrpcWorkerSetup, reserve_port
from quiver.frontends.http import HttpFrontend
from quiver.frontends.metrics import MetricsFrontend
from quiver.frontends.offload import set_codec_threads
from quiver.frontends.restrictions import Restrictions
from quiver.frontends.sagemaker import SageMakerFrontend
from quiver.frontends.workers import FrontendWorkers
from quiver.heap import freeze_heap
from quiver.lifecycle import ModelRepositoryManager
from quiver.lifecycle.sources import default_cache_dir
from quiver.limits import raise_open_file_limit
from quiver.metrics.prometheus import MultiModelView, TritonCollector
from quiver.repository.archive import ExtractLimits
from quiver.repository.local import use_custom_config
from quiver.response_cache import ResponseCache
from quiver.service import InferenceService
from quiver.settings import Settings
from quiver.shared_memory import SharedMemoryManager
from quiver.tracing import TraceManager
from quiver.tracing.otel import MissingOpenTelemetry, OpenTelemetryExporter

if TYPE_CHECKING:
    from quiver.metrics.cloudwatch import CloudWatchPublisher

logger = logging.getLogger(__name__)


class StartError(Exception):
    """A start-up step failed; ``exit_code`` is the process's exit code."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# -- assembly (shared with the Ray replica) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Parts:
    """What one server is made of; nothing here is started yet."""

    manager: ModelRepositoryManager
    service: InferenceService
    http: HttpFrontend  # the v2 API over HTTP
    sagemaker: SageMakerFrontend | None  # the SageMaker routes, when settings.sagemaker is set


def assemble(settings: Settings) -> Parts:
    """The model manager, the inference service over it and its HTTP applications."""
    use_custom_config(settings.model_config_name)  # --model-config-name (checked by settings)
    SERVER.backend_config = settings.backend_config
    SERVER.cache_dir = settings.model_cache_dir or default_cache_dir()
    manager = ModelRepositoryManager(
        list(settings.model_repositories),
        control_mode=settings.model_control_mode,
        memory_limit_bytes=settings.model_memory_limit,
        gpu_limit=settings.model_load_gpu_limit,
        eviction_policy=settings.model_eviction_policy,
        evict_ahead=settings.model_evict_ahead,
        load_wait_timeout=settings.model_load_wait_timeout,
        startup_models=list(settings.load_models),
        strict_config=settings.strict_model_config,
        load_threads=settings.model_load_thread_count,
        load_retries=settings.model_load_retry_count,
        inline_threshold_ns=settings.inline_execution_threshold_us * 1000,
        remote_repositories=list(settings.s3_repositories),
        s3_options=settings.s3_options,
        cache_dir=settings.model_cache_dir,
        cache_size=settings.model_cache_size,
        archive_limits=ExtractLimits(
            max_bytes=settings.model_archive_max_bytes or settings.model_cache_size,
            max_files=settings.model_archive_max_files,
            max_ratio=settings.model_archive_max_ratio,
        ),
        cache_revalidate_timeout=settings.model_cache_revalidate_timeout,
        cache_revalidate=settings.model_cache_revalidate,
        namespacing=settings.model_namespacing,
    )
    service = InferenceService(
        manager,
        repositories=list(settings.model_repositories),
        tracing=TraceManager(settings.trace),
        response_cache=ResponseCache(settings.response_cache_size) if settings.response_cache_size else None,
        shared_memory=SharedMemoryManager(allow_client=settings.allow_client_shm),
        server_id=settings.server_id,
        strict_readiness=settings.strict_readiness,
    )
    http = HttpFrontend(
        service,
        max_input_size=settings.http_max_input_size,
        restrictions=Restrictions(list(settings.http_restricted_api)),
        header_forward_pattern=settings.http_header_forward_pattern,
    )
    sagemaker = None
    if settings.sagemaker is not None:
        sagemaker = SageMakerFrontend(
            service, settings.sagemaker, max_input_size=settings.http_max_input_size
        )
    return Parts(manager, service, http, sagemaker)


def configure_logging(settings: Settings) -> None:
    """``--log-*``; a log file or folder that cannot be opened raises StartError (exit 2)."""
    try:
        logs.configure(
            verbose=settings.log_verbose,
            info=settings.log_info,
            warning=settings.log_warning,
            error=settings.log_error,
            log_file=settings.log_file,
            log_format=settings.log_format,
            log_file_dir=settings.log_file_dir,
        )
    except InvalidArgumentError as exc:
        raise StartError(str(exc), exit_code=2) from None


async def load_models(parts: Parts, settings: Settings) -> None:
    """Start the manager (the models its control mode loads at start); with
    ``--exit-on-error`` a model that fails to load raises StartError."""
    failures = await parts.manager.start(poll_seconds=settings.repository_poll_secs)
    _log_model_table(parts.manager)
    if failures and settings.exit_on_error:
        raise StartError(
            f"{len(failures)} model(s) failed to load and --exit-on-error is true: "
            + "; ".join(f"{name}: {reason}" for name, reason in sorted(failures.items()))
        )


# -- listeners ---------------------------------------------------------------------------------


class _Listener(abc.ABC):
    """One open listener: ``begin_stop`` stops taking requests without waiting, ``close``
    waits for the in-flight ones and releases the port."""

    name = ""

    @abc.abstractmethod
    async def begin_stop(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


class _AsgiListener(_Listener):
    def __init__(self, name: str, server: AsgiServer, serving: asyncio.Task[None], sock: socket.socket) -> None:
        self.name = name
        self.server = server
        self.serving = serving
        self.socket = sock

    async def begin_stop(self) -> None:
        self.server.should_exit = True

    async def close(self) -> None:
        self.server.should_exit = True
        try:
            await self.serving
        finally:
            self.socket.close()


class _GrpcListener(_Listener):
    name = "GRPC"

    def __init__(self, frontend: GrpcFrontend, grace: float) -> None:
        self.frontend = frontend
        self.grace = grace
        self._stopping: asyncio.Task[None] | None = None

    async def begin_stop(self) -> None:
        await self.frontend.begin_shutdown()  # health NOT_SERVING before anything closes
        self._stopping = asyncio.create_task(self.frontend.stop(grace=self.grace))

    async def close(self) -> None:
        if self._stopping is None:
            # Start-up failed after this listener opened: the process exits without
            # finalizing (cli), which closes the port. Stopping a grpc.aio server moments after
            # it started can crash the process (SIGSEGV), so it is not stopped here.
            return
        await self._stopping


class _WorkersListener(_Listener):
    """HTTP, gRPC and SageMaker served by worker processes (``--frontend-workers``) on the
    HTTP and SageMaker sockets this process bound and the gRPC port it holds."""

    name = "HTTP"

    def __init__(self, workers: FrontendWorkers) -> None:
        self.workers = workers
        self.socket = workers.socket
        self.grpc_socket = workers.grpc_socket
        self.sagemaker_socket = workers.sagemaker_socket

    async def begin_stop(self) -> None:
        await self.workers.begin_stop()

    async def close(self) -> None:
        await self.workers.close()


class _MetricsListener(_Listener):
    name = "Metrics"

    def __init__(self, frontend: MetricsFrontend) -> None:
        self.frontend = frontend

    async def begin_stop(self) -> None:
        pass  # scrapes go on while the other listeners drain

    async def close(self) -> None:
        await self.frontend.stop()


def _listen(address: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # --reuse-http-port: several servers may listen on the port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {address}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _listen_in_range(address: str, port_range: tuple[int, int]) -> socket.socket:
    low, high = port_range
    for port in range(low, high + 1):
        try:
            return _listen(address, port)
        except OSError:
            continue
    raise OSError(f"no free port for the SageMaker listener in the safe port range {low}-{high}")


async def _serve_asgi(
    name: str, app: object, sock: socket.socket, grace: float = 30.0, on_request: Callable[[], None] | None = None
) -> _AsgiListener:
    try:
        server, serving = await serve(app, sock, graceful_seconds=grace, on_request=on_request)
    except BaseException as exc:
        sock.close()
        if isinstance(exc, Exception):
            raise OSError(f"the {name} listener stopped at start: {exc}") from None
        raise
    return _AsgiListener(name, server, serving, sock)


async def _serve_workers(
    parts: Parts,
    settings: Settings,
    sock: socket.socket | None,
    grpc_socket: socket.socket | None,
    sagemaker_socket: socket.socket | None,
) -> _WorkersListener:
    grpc = None
    if grpc_socket is not None:
        grpc = GrpcWorkerSetup(
            settings.grpc_address,
            grpc_socket.getsockname()[1],
            max_message_size=settings.grpc_max_message_size,
            restricted_protocol=list(settings.grpc_restricted_protocol),
            header_forward_pattern=settings.grpc_header_forward_pattern,
            tls=settings.grpc_tls,
            options=list(settings.grpc_options),
            compression_level=settings.grpc_compression_level,
            server=settings.grpc_server,
        )
    workers = FrontendWorkers(
        parts.service,
        parts.http.app(),
        sock,
        settings.frontend_workers,
        grpc=grpc,
        grpc_socket=grpc_socket,
        sagemaker=parts.sagemaker,
        sagemaker_socket=sagemaker_socket,
        max_input_size=settings.http_max_input_size,
        restricted_api=list(settings.http_restricted_api),
        graceful_seconds=settings.exit_timeout_secs,
        log_verbose=settings.log_verbose,
        header_forward_pattern=settings.http_header_forward_pattern,
    )
    try:
        await workers.start()
    except BaseException:
        await workers.close()
        raise
    protocols = (("HTTP", sock), ("gRPC", grpc_socket), ("SageMaker", sagemaker_socket))
    names = [name for name, on in protocols if on is not None]
    served = f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]
    logger.info("%s served by %d worker processes (pids %s)", served, workers.count, " ".join(map(str, workers.pids)))
    return _WorkersListener(workers)


# -- the single-process server -----------------------------------------------------------------


class Runner:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.parts: Parts | None = None
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        """Start, serve until a signal (or a listener stops by itself), stop; the exit code."""
        raise_open_file_limit()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        async with contextlib.AsyncExitStack() as stack:
            try:
                listeners = await self._start(stack)
            except StartError as exc:
                if exc.exit_code == 2:  # logging is not set up: say it as other flag errors do
                    print(f"quiver: error: {exc}", file=sys.stderr)
                else:
                    logger.error("%s", exc)
                return exc.exit_code  # the stack closes what was opened, last first
            await self._serve(listeners)
            assert self.parts is not None
            self.parts.service.ready = False
            logger.info("stopping: draining in-flight requests")
            # Every listener stops taking requests now (gRPC's health says NOT_SERVING before
            # any closes) and drains while the stack closes them one by one, HTTP first.
            for listener in sorted(listeners, key=lambda each: not isinstance(each, _GrpcListener)):
                await listener.begin_stop()
        logger.info("stopped")
        return 0

    async def _start(self, stack: contextlib.AsyncExitStack) -> list[_Listener]:
        settings = self.settings
        configure_logging(settings)  # 1.
        if settings.sagemaker_thread_count:
            set_codec_threads(settings.sagemaker_thread_count)
            logger.info("%d codec threads (--sagemaker-thread-count)", settings.sagemaker_thread_count)
        for note in settings.flag_notes:
            logger.info("%s", note)
        # 2. the metrics registry, 3. the manager (assembled first: the collector reads it;
        # assembling opens nothing). The disk cache opens on first use and closes with it.
        parts = self.parts = assemble(settings)
        _start_tracing(parts.service.tracing, stack)
        registry: CollectorRegistry | None = None
        if settings.allow_metrics:
            collector = _metrics_collector(parts.manager, settings, parts.service.response_cache)
            stack.callback(collector.close)
            registry = CollectorRegistry(auto_describe=False)
            registry.register(collector)
        stack.push_async_callback(parts.manager.stop)
        stack.callback(parts.service.shared_memory.close)  # after the listeners have closed
        # 4. the models loaded at start
        await load_models(parts, settings)
        # CloudWatch (started once the listeners are up) stops after they drained, so its last
        # publication counts every request, and before the models unload.
        publishers: list[CloudWatchPublisher] = []

        async def stop_publishing() -> None:
            for publisher in publishers:
                await publisher.stop()

        stack.push_async_callback(stop_publishing)
        # 5. the listeners
        listeners: list[_Listener] = []

        def opened(listener: _Listener) -> None:
            listeners.append(listener)
            stack.push_async_callback(listener.close)

        try:
            if registry is not None:
                metrics = MetricsFrontend(registry, on_request=parts.service.request_came)
                metrics.bind(settings.metrics_address, settings.metrics_port)
                opened(_MetricsListener(metrics))
                await metrics.start()  # logs 'started Metrics service at HOST:PORT'
            workers = settings.frontend_workers > 1 and (
                settings.allow_grpc or settings.allow_http or settings.allow_sagemaker
            )
            sagemaker_socket = None
            if settings.allow_sagemaker:
                assert parts.sagemaker is not None
                safe = settings.sagemaker_safe_port_range
                if settings.sagemaker_port == 0 and safe is not None:
                    sagemaker_socket = _listen_in_range(settings.sagemaker_address, safe)
                else:
                    sagemaker_socket = _listen(settings.sagemaker_address, settings.sagemaker_port)
                if not workers:
                    opened(await _serve_asgi(
                        "SageMaker", parts.sagemaker, sagemaker_socket, settings.exit_timeout_secs, parts.service.request_came
                    ))
            grpc: GrpcFrontend | None = None
            if workers:
                sockets: list[socket.socket | None] = [sagemaker_socket]
                try:
                    grpc_socket = reserve_port(settings.grpc_address, settings.grpc_port) if settings.allow_grpc else None
                    sockets.append(grpc_socket)
                    http_socket = None
                    if settings.allow_http:
                        http_socket = _listen(settings.http_address, settings.http_port, settings.reuse_http_port)
                except OSError:
                    for sock in sockets:
                        if sock is not None:
                            sock.close()
                    raise
                opened(await _serve_workers(parts, settings, http_socket, grpc_socket, sagemaker_socket))
            elif settings.allow_grpc:
                grpc = GrpcFrontend(
                    parts.service,
                    max_message_size=settings.grpc_max_message_size,
                    restrictions=Restrictions(list(settings.grpc_restricted_protocol)),
                    header_forward_pattern=settings.grpc_header_forward_pattern,
                    tls=settings.grpc_tls,
                    options=settings.grpc_options,
                    compression_level=settings.grpc_compression_level,
                    reuse_port=settings.reuse_grpc_port,
                    server_kind=settings.grpc_server,
                    on_request=parts.service.request_came,
                )
                grpc_port = await grpc.start(settings.grpc_address, settings.grpc_port)
                opened(_GrpcListener(grpc, settings.exit_timeout_secs))
            if settings.allow_http and not workers:
                sock = _listen(settings.http_address, settings.http_port, settings.reuse_http_port)
                opened(await _serve_asgi("HTTP", parts.http.app(), sock, settings.exit_timeout_secs, parts.service.request_came))
        except OSError as exc:
            raise StartError(str(exc)) from None
        if settings.cloudwatch is not None and registry is not None:
            publisher = _cloudwatch_publisher(registry, settings)
            publisher.start()
            publishers.append(publisher)
        freeze_heap("started")  # what the start made stays: full collections skip it
        parts.service.ready = True
        for listener in listeners:
            if isinstance(listener, _WorkersListener):
                if listener.sagemaker_socket is not None:  # the lines in the single process's order
                    host, port = listener.sagemaker_socket.getsockname()[:2]
                    logger.info("started SageMaker service at %s:%d", host, port)
                if listener.grpc_socket is not None:
                    host, port = listener.grpc_socket.getsockname()[:2]
                    logger.info("started GRPC service at %s:%d", host, port)
                if listener.socket is not None:
                    host, port = listener.socket.getsockname()[:2]
                    logger.info("started HTTP service at %s:%d", host, port)
            elif isinstance(listener, _AsgiListener):
                host, port = listener.socket.getsockname()[:2]
                logger.info("started %s service at %s:%d", listener.name, host, port)
            elif isinstance(listener, _GrpcListener) and grpc is not None:
                await grpc.set_serving(True)
                logger.info("started GRPC service at %s:%d", settings.grpc_address, grpc_port)
        return listeners

    async def _serve(self, listeners: list[_Listener]) -> None:
        """Until a stop is requested or an HTTP listener stops by itself."""
        stop_wait = asyncio.create_task(self._stop.wait())
        waits: set[asyncio.Future[Any]] = {stop_wait}
        waits |= {listener.serving for listener in listeners if isinstance(listener, _AsgiListener)}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()


def _log_model_table(manager: ModelRepositoryManager) -> None:
    rows = [(s.name, s.version or "-", s.state.value + (f": {s.reason}" if s.reason else "")) for s in manager.index()]
    if not rows:
        logger.warning("no models found in the model repository")
        return
    widths = [max(len(r[i]) for r in [*rows, ("Model", "Version", "Status")]) for i in range(2)]
    lines = [f"{'Model':<{widths[0]}}  {'Version':<{widths[1]}}  Status"]
    lines += [f"{n:<{widths[0]}}  {v:<{widths[1]}}  {s}" for n, v, s in rows]
    logger.info("model repository:\n%s", "\n".join(lines))


def _cloudwatch_publisher(registry: CollectorRegistry, settings: Settings) -> CloudWatchPublisher:
    assert settings.cloudwatch is not None
    from quiver.metrics.cloudwatch import CloudWatchPublisher

    return CloudWatchPublisher(
        registry.collect,
        log_group=settings.cloudwatch.log_group,
        namespace=settings.cloudwatch.namespace,
        interval=settings.cloudwatch.interval,
    )


def _start_tracing(tracing: TraceManager, stack: contextlib.AsyncExitStack) -> None:
    """Log the trace flags' warnings, open the OpenTelemetry exporter (mode opentelemetry);
    at stop (after the listeners and the models) write the traces held, flush the spans."""
    config = tracing.config
    for warning in config.warnings:
        logger.warning("%s", warning)
    folder = Path(config.file).parent if config.file else None
    if config.mode == "triton" and folder is not None and not folder.is_dir():
        raise StartError(f"--trace-config triton,file={config.file}: the folder {folder} does not exist", 2)
    if config.mode == "opentelemetry":
        try:
            tracing.exporter = OpenTelemetryExporter(config)
        except MissingOpenTelemetry as exc:
            raise StartError(str(exc)) from None
    stack.callback(tracing.close)
    if config.level:
        where = config.file if config.mode == "triton" else tracing.exporter.url
        logger.info("tracing: mode %s, rate %d, count %d, to %s", config.mode, config.rate, config.count, where)


def _metrics_collector(
    manager: ModelRepositoryManager, settings: Settings, response_cache: ResponseCache | None = None
) -> TritonCollector:
    """Triton's metrics, for a registry of this server's own (not prometheus_client's global
    one); the multi-model ones with on_demand, a memory limit or a SageMaker multi-model endpoint."""
    multi_model_endpoint = settings.sagemaker is not None and settings.sagemaker.multi_model

    def multi_model() -> MultiModelView | None:
        used, limit = manager.memory
        if not manager.on_demand and not limit and not multi_model_endpoint:
            return None
        resident = {m.name: m.size_bytes for m in manager.ready_models}
        disk = manager.disk_cache_stats
        cache_used, cache_size = manager.disk_cache_usage
        return MultiModelView(
            manager.multi_model,
            resident,
            used,
            limit,
            disk_cache_hits=disk.hits + disk.stale_hits if disk else 0,
            disk_cache_misses=disk.misses if disk else 0,
            disk_cache_stale_hits=disk.stale_hits if disk else 0,
            disk_cache_checked_later=disk.checked_later if disk else 0,
            disk_cache_outdated=disk.outdated if disk else 0,
            disk_cache_damaged=disk.damaged if disk else 0,
            disk_cache_used=cache_used,
            disk_cache_size=cache_size,
            memory_reserved=manager.memory_reserved,
            framework_bytes=manager.framework_bytes,
        )

    return TritonCollector(
        lambda: manager.ready_models,
        response_cache=response_cache,
        multi_model=multi_model,
        cpu=settings.allow_cpu_metrics,
        gpu=settings.allow_gpu_metrics,
        interval_ms=settings.metrics_interval_ms,
    )
