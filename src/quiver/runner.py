"""Assembly and ordered start/stop of one Quiver server process.

Start: load the repository, then open the listeners. Stop (SIGINT/SIGTERM): close the
listeners and let in-flight requests finish, drain every model's scheduler, unload the
models (running ``finalize``), exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.registry import CollectorRegistry

from quiver.errors import QuiverError
from quiver.frontends.asgi import AsgiServer, serve
from quiver.frontends.grpc import GrpcFrontend
from quiver.frontends.http import HttpFrontend
from quiver.frontends.metrics import MetricsFrontend
from quiver.frontends.restrictions import Restrictions
from quiver.frontends.sagemaker import (
    SageMakerFrontend,
    SageMakerSettings,
    check_port,
    parse_port_range,
)
from quiver.lifecycle import ModelRepositoryManager
from quiver.lifecycle.manager import DEFAULT_CACHE_BYTES
from quiver.metrics.prometheus import MultiModelView, TritonCollector
from quiver.repository.archive import DEFAULT_MAX_FILES, DEFAULT_MAX_RATIO, ExtractLimits
from quiver.repository.cache import DEFAULT_REVALIDATE_TIMEOUT
from quiver.service import InferenceService

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerOptions:
    model_repositories: list[Path]
    http_address: str = "127.0.0.1"
    http_port: int = 8000
    grpc_address: str = "127.0.0.1"
    grpc_port: int = 8001
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 8002
    model_control_mode: str = "none"
    load_models: list[str] = field(default_factory=list)
    model_memory_limit: int = 0
    model_load_gpu_limit: float = 0.0  # fraction of each GPU's memory; 0: no limit
    model_eviction_policy: str = "lru"
    model_load_wait_timeout: float = 60.0
    repository_poll_secs: float = 15.0
    strict_model_config: bool = False
    exit_on_error: bool = True
    model_load_thread_count: int = 4
    http_max_input_size: int = 64 * 1024 * 1024
    http_restricted_api: list[str] = field(default_factory=list)
    grpc_restricted_protocol: list[str] = field(default_factory=list)
    inline_execution_threshold_us: int = 200
    allow_http: bool = True
    allow_grpc: bool = True
    allow_metrics: bool = True
    allow_cpu_metrics: bool = True
    allow_gpu_metrics: bool = True
    metrics_interval_ms: int = 2000
    grpc_max_message_size: int = 64 * 1024 * 1024
    allow_sagemaker: bool = False
    sagemaker_address: str = "127.0.0.1"
    sagemaker_port: int = 8080
    sagemaker_safe_port_range: str = ""  # "LOW-HIGH"; empty: any port
    sagemaker_settings: SageMakerSettings | None = None  # None: from the SAGEMAKER_* variables
    s3_repositories: list[str] = field(default_factory=list)  # s3://bucket/prefix locations
    s3_options: dict[str, Any] = field(default_factory=dict)  # S3Storage options (endpoint, ...)
    model_cache_dir: Path | None = None  # None: $QUIVER_CACHE_DIR or a folder under the temp dir
    model_cache_size: int = DEFAULT_CACHE_BYTES
    model_archive_max_bytes: int = 0  # expanded bytes of one archive; 0: the cache size
    model_archive_max_ratio: float = DEFAULT_MAX_RATIO  # 0: no ratio limit
    model_archive_max_files: int = DEFAULT_MAX_FILES
    model_cache_revalidate_timeout: float = DEFAULT_REVALIDATE_TIMEOUT  # seconds
    extra: dict[str, object] = field(default_factory=dict)


def _listen(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {address}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def repository_manager(options: ServerOptions) -> ModelRepositoryManager:
    """The model repository manager the options describe (not started)."""
    return ModelRepositoryManager(
        options.model_repositories,
        control_mode=options.model_control_mode,
        memory_limit_bytes=options.model_memory_limit,
        gpu_limit=options.model_load_gpu_limit,
        eviction_policy=options.model_eviction_policy,
        load_wait_timeout=options.model_load_wait_timeout,
        startup_models=options.load_models,
        strict_config=options.strict_model_config,
        load_threads=options.model_load_thread_count,
        inline_threshold_ns=options.inline_execution_threshold_us * 1000,
        remote_repositories=options.s3_repositories,
        s3_options=options.s3_options,
        cache_dir=options.model_cache_dir,
        cache_size=options.model_cache_size,
        archive_limits=ExtractLimits(
            max_bytes=options.model_archive_max_bytes or options.model_cache_size,
            max_files=options.model_archive_max_files,
            max_ratio=options.model_archive_max_ratio,
        ),
        cache_revalidate_timeout=options.model_cache_revalidate_timeout,
    )


class Runner:
    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.manager = repository_manager(options)
        self.service = InferenceService(self.manager)
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)

        failures = await self.manager.start(poll_seconds=self.options.repository_poll_secs)
        _log_model_table(self.manager)
        if failures and self.options.exit_on_error:
            logger.error(
                "%d model(s) failed to load and --exit-on-error is true; exiting", len(failures)
            )
            await self.manager.stop()
            return 1

        opts = self.options
        metrics = _metrics_frontend(self.manager, opts) if opts.allow_metrics else None
        if metrics is not None:
            try:
                metrics.bind(opts.metrics_address, opts.metrics_port)
            except OSError:
                await self.manager.stop()
                raise
        sagemaker: tuple[AsgiServer, asyncio.Task[None], socket.socket] | None = None
        if opts.allow_sagemaker:
            try:
                sagemaker = await _start_sagemaker(self.service, opts)
            except OSError:
                await self.manager.stop()
                raise
        grpc_frontend: GrpcFrontend | None = None
        if opts.allow_grpc:
            grpc_frontend = GrpcFrontend(
                self.service,
                max_message_size=opts.grpc_max_message_size,
                restrictions=Restrictions(opts.grpc_restricted_protocol),
            )
            grpc_port = await grpc_frontend.start(opts.grpc_address, opts.grpc_port)
        http_server: AsgiServer | None = None
        http_socket: socket.socket | None = None
        serving: asyncio.Task[None] | None = None
        if opts.allow_http:
            frontend = HttpFrontend(
                self.service,
                max_input_size=opts.http_max_input_size,
                restrictions=Restrictions(opts.http_restricted_api),
            )
            try:
                http_socket = _listen(opts.http_address, opts.http_port)
            except OSError:
                if grpc_frontend is not None:
                    await grpc_frontend.stop(0)
                raise
            host, port = http_socket.getsockname()[:2]
            try:
                http_server, serving = await serve(frontend.app(), http_socket, graceful_seconds=30)
            except BaseException:
                if grpc_frontend is not None:
                    await grpc_frontend.stop(0)
                await self.manager.stop()
                raise
        if metrics is not None:
            await metrics.start()  # logs 'started Metrics service at HOST:PORT'
        self.service.ready = True
        if sagemaker is not None:
            sm_host, sm_port = sagemaker[2].getsockname()[:2]
            logger.info("started SageMaker service at %s:%d", sm_host, sm_port)
        if grpc_frontend is not None:
            await grpc_frontend.set_serving(True)
            logger.info("started GRPC service at %s:%d", opts.grpc_address, grpc_port)
        if http_server is not None:
            logger.info("started HTTP service at %s:%d", host, port)

        stop_wait = asyncio.create_task(self._stop.wait())
        waits: set[asyncio.Task[None] | asyncio.Task[bool]] = {stop_wait}
        if serving is not None:
            waits.add(serving)
        if sagemaker is not None:
            waits.add(sagemaker[1])
        _done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        self.service.ready = False
        logger.info("stopping: draining in-flight requests")
        draining: list[Awaitable[None]] = []
        if grpc_frontend is not None:
            await grpc_frontend.begin_shutdown()  # health NOT_SERVING before anything closes
            draining.append(grpc_frontend.stop(grace=30))
        if http_server is not None and serving is not None:
            http_server.should_exit = True
            draining.append(serving)
        if sagemaker is not None:
            sagemaker[0].should_exit = True
            draining.append(sagemaker[1])
        await asyncio.gather(*draining)
        if metrics is not None:
            await metrics.stop()
        stop_wait.cancel()
        await self.manager.stop()
        if http_socket is not None:
            http_socket.close()
        if sagemaker is not None:
            sagemaker[2].close()
        logger.info("stopped")
        return 0


def _log_model_table(manager: ModelRepositoryManager) -> None:
    rows = [(s.name, s.version or "-", s.state.value + (f": {s.reason}" if s.reason else "")) for s in manager.index()]
    if not rows:
        logger.warning("no models found in the model repository")
        return
    widths = [max(len(r[i]) for r in [*rows, ("Model", "Version", "Status")]) for i in range(2)]
    lines = [f"{'Model':<{widths[0]}}  {'Version':<{widths[1]}}  Status"]
    lines += [f"{n:<{widths[0]}}  {v:<{widths[1]}}  {s}" for n, v, s in rows]
    logger.info("model repository:\n%s", "\n".join(lines))


def _metrics_frontend(manager: ModelRepositoryManager, opts: ServerOptions) -> MetricsFrontend:
    """Triton's metrics on a registry of this server's own (not prometheus_client's global one)."""
    def multi_model() -> MultiModelView | None:
        used, limit = manager.memory
        if not manager.on_demand and not limit:
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
            disk_cache_damaged=disk.damaged if disk else 0,
            disk_cache_used=cache_used,
            disk_cache_size=cache_size,
            memory_reserved=manager.memory_reserved,
            framework_bytes=manager.framework_bytes,
        )

    collector = TritonCollector(
        lambda: manager.ready_models,
        multi_model=multi_model,
        cpu=opts.allow_cpu_metrics,
        gpu=opts.allow_gpu_metrics,
        interval_ms=opts.metrics_interval_ms,
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return MetricsFrontend(registry, on_stop=collector.close)


async def _start_sagemaker(
    service: InferenceService, opts: ServerOptions
) -> tuple[AsgiServer, asyncio.Task[None], socket.socket]:
    """Open the SageMaker listener (``--sagemaker-port``; port 0 picks a free one, inside
    the safe port range when there is one) and serve it; raises OSError with the reason."""
    try:
        settings = opts.sagemaker_settings or SageMakerSettings.from_env()
        safe = parse_port_range(opts.sagemaker_safe_port_range) if opts.sagemaker_safe_port_range else None
        check_port(opts.sagemaker_port, safe)
    except QuiverError as exc:
        raise OSError(str(exc)) from None
    if opts.sagemaker_port == 0 and safe is not None:
        sock = _listen_in_range(opts.sagemaker_address, safe)
    else:
        sock = _listen(opts.sagemaker_address, opts.sagemaker_port)
    frontend = sagemaker_frontend(service, opts, settings)
    try:
        server, task = await serve(frontend, sock, graceful_seconds=30)
    except BaseException as exc:
        sock.close()
        raise OSError(f"the SageMaker listener stopped at start: {exc}") from None
    return server, task, sock


def sagemaker_frontend(
    service: InferenceService, opts: ServerOptions, settings: SageMakerSettings
) -> SageMakerFrontend:
    """The SageMaker routes' ASGI application for ``service``."""
    manager = service.manager

    async def load_from(name: str, url: str, target: str) -> str:
        return await manager.load_url(name, url)

    return SageMakerFrontend(
        service,
        settings,
        repositories=opts.model_repositories,
        max_input_size=opts.http_max_input_size,
        # S3 locations, archives and folders outside the repositories: the multi-model manager.
        load_from=load_from if manager.on_demand else None,
    )


def _listen_in_range(address: str, port_range: tuple[int, int]) -> socket.socket:
    low, high = port_range
    for port in range(low, high + 1):
        try:
            return _listen(address, port)
        except OSError:
            continue
    raise OSError(f"no free port for the SageMaker listener in the safe port range {low}-{high}")
