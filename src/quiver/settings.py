"""``quiver serve``'s flags and environment variables, merged once into one frozen object.

:func:`from_args` is the only place that reads the environment for the server's settings, and
nothing changes a :class:`Settings` once built (``dataclasses.replace`` makes a new one). The
precedence, for every setting that has both a flag and a variable:

- a flag given on the command line wins;
- else Triton's variable: ``SAGEMAKER_BIND_TO_PORT`` (``--sagemaker-port``),
  ``SAGEMAKER_SAFE_PORT_RANGE`` (``--sagemaker-safe-port-range``),
  ``SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT`` (``--model-load-gpu-limit``),
  ``SAGEMAKER_MULTI_MODEL`` or any ``SAGEMAKER_TRITON_*`` (``--allow-sagemaker``);
  ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL`` (``--s3-endpoint-url``);
  ``SAGEMAKER_TRITON_SHM_DEFAULT_BYTE_SIZE`` / ``SAGEMAKER_TRITON_SHM_GROWTH_BYTE_SIZE``
  (``--backend-config=python,shm-default-byte-size=N`` / ``shm-growth-byte-size=N``);
- else the built-in default.

The SageMaker routes' own settings (``SAGEMAKER_MULTI_MODEL``, ``SAGEMAKER_TRITON_PING_MODE``,
``SAGEMAKER_TRITON_DEFAULT_MODEL_NAME``) are read here too, when the routes are on (always
with ``--ray``). Left to their owners, on purpose: ``QUIVER_CACHE_DIR`` (the model manager's
default cache folder when ``--model-cache-dir`` is not given: it may fall back to a private
folder when another process holds that default, which an explicit folder never does) and the
AWS credentials, profile and region (boto3 reads them; secrets are not copied into settings
that travel to Ray replicas).

A :class:`SettingsError` names the flag or variable that makes no sense; the command line
prints it and exits 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from quiver.backends.onnxruntime_optimized import CACHE as ONNXRUNTIME_OPTIMIZED_CACHE
from quiver.backends.onnxruntime_optimized import KEYS as ONNXRUNTIME_OPTIMIZED_KEYS
from quiver.backends.onnxruntime_optimized import check_settings as check_onnxruntime_optimized
from quiver.backends.onnxruntime_threads import GLOBAL_THREADPOOL as ONNXRUNTIME_GLOBAL_THREADPOOL
from quiver.backends.onnxruntime_threads import KEYS as ONNXRUNTIME_KEYS
from quiver.backends.onnxruntime_threads import check_settings as check_onnxruntime_settings
from quiver.backends.python_settings import parse_python_settings
from quiver.errors import InvalidArgumentError
from quiver.frontends.restrictions import Restrictions
from quiver.frontends.sagemaker import (
    DEFAULT_PORT,
    SageMakerSettings,
    check_port,
    enabled_by_env,
    parse_port_range,
)
from quiver.frontends.worker_count import auto_frontend_workers, usable_cores
from quiver.lifecycle.manager import DEFAULT_CACHE_BYTES
from quiver.lifecycle.policies import DEFAULT_POLICY
from quiver.repository.archive import DEFAULT_MAX_FILES, DEFAULT_MAX_RATIO
from quiver.repository.cache import DEFAULT_REVALIDATE_TIMEOUT
from quiver.repository.storage import RetryPolicy
from quiver.response_cache import CacheConfigError, parse_cache_config
from quiver.tracing import TraceConfig, TraceConfigError
from quiver.tracing import config as trace_config
from quiver.triton_flags import FlagError, GrpcTls
from quiver.triton_flags import settings as triton_settings

#: ``--s3-retries`` when none is given (S3Storage's own default then applies).
DEFAULT_S3_RETRIES = 5


class SettingsError(ValueError):
    """A flag or variable whose value makes no sense (the message names it)."""


@dataclass(frozen=True, slots=True)
class RaySettings:
    """``--ray-*``: the Ray Serve deployment of ``quiver serve --ray``."""

    address: str = ""  # "" starts a local cluster; "auto", "HOST:PORT" or "ray://HOST:PORT" attach
    num_cpus: int | None = None  # CPUs of a local cluster (None: the machine's)
    replicas: int = 1  # replicas when not autoscaling
    min_replicas: int | None = None  # autoscaling when min or max is given
    max_replicas: int | None = None
    target_ongoing_requests: float = 2.0
    max_ongoing_requests: int = 32
    replica_cpus: float = 1.0
    request_retries: int = 1
    request_timeout: float = 300.0
    graceful_shutdown_timeout: float = 30.0
    routing_stats_period: float = 1.0

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None


@dataclass(frozen=True, slots=True)
class CloudWatchSettings:
    """``--cloudwatch-*``: where the metrics are published (:mod:`quiver.metrics.cloudwatch`)."""

    log_group: str
    namespace: str
    interval: float = 60.0


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything one Quiver server (or Ray replica) is assembled and started from."""

    model_repositories: tuple[Path, ...] = ()
    s3_repositories: tuple[str, ...] = ()  # s3://bucket/prefix locations
    # listeners
    http_address: str = "127.0.0.1"
    http_port: int = 8000
    grpc_address: str = "127.0.0.1"
    grpc_port: int = 8001
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 8002
    allow_http: bool = True
    allow_grpc: bool = True
    allow_metrics: bool = True
    allow_cpu_metrics: bool = True
    allow_gpu_metrics: bool = True
    metrics_interval_ms: int = 2000
    http_max_input_size: int = 64 * 1024 * 1024
    frontend_workers: int = 0  # HTTP and gRPC frontend worker processes; 0 or 1: served in this process
    grpc_max_message_size: int = 64 * 1024 * 1024
    grpc_server: str = "quiver"  # quiver: Quiver's own gRPC server; grpcio: grpc.aio's
    http_restricted_api: tuple[str, ...] = ()
    grpc_restricted_protocol: tuple[str, ...] = ()
    # SageMaker: sagemaker is the routes' settings when allow_sagemaker (or --ray), else None
    allow_sagemaker: bool = False
    sagemaker_address: str = "127.0.0.1"
    sagemaker_port: int = DEFAULT_PORT
    sagemaker_safe_port_range: tuple[int, int] | None = None  # None: any port
    sagemaker: SageMakerSettings | None = None
    # models
    sagemaker_thread_count: int = 0  # codec threads; 0: the default
    model_control_mode: str = "none"
    load_models: tuple[str, ...] = ()
    model_memory_limit: int = 0
    model_load_gpu_limit: float = 0.0  # fraction of each GPU's memory; 0: no limit
    model_eviction_policy: str = DEFAULT_POLICY
    model_evict_ahead: bool = True
    model_load_wait_timeout: float = 60.0
    repository_poll_secs: float = 15.0
    strict_model_config: bool = False
    exit_on_error: bool = True
    model_load_thread_count: int = 4
    inline_execution_threshold_us: int = 200
    model_namespacing: bool = True
    # --backend-config: backend name ("" for the global settings) -> key -> value, as given
    backend_config: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # model cache and S3
    model_cache_dir: Path | None = None  # None: the manager's default ($QUIVER_CACHE_DIR, ...)
    model_cache_size: int = DEFAULT_CACHE_BYTES
    model_archive_max_bytes: int = 0  # expanded bytes of one archive; 0: the cache size
    model_archive_max_ratio: float = DEFAULT_MAX_RATIO  # 0: no ratio limit
    model_archive_max_files: int = DEFAULT_MAX_FILES
    model_cache_revalidate_timeout: float = DEFAULT_REVALIDATE_TIMEOUT  # seconds
    model_cache_revalidate: str = "background"  # or "always"
    s3_endpoint_url: str | None = None  # None: AWS itself
    s3_region: str | None = None  # None: boto3's (AWS_DEFAULT_REGION, the profile)
    s3_retry: RetryPolicy | None = None  # None: S3Storage's default
    # logging
    log_verbose: int = 0
    log_info: bool = True
    log_file: str = ""
    log_format: str = "default"
    log_file_dir: str | None = None  # the logging API's folder; None: the API may not set log_file
    # CloudWatch: None publishes nothing
    cloudwatch: CloudWatchSettings | None = None
    # Triton's other flags (quiver.triton_flags)
    server_id: str = "quiver"  # --id: the server's name in its metadata
    allow_client_shm: bool = False  # --allow-client-shm: clients may register regions
    model_config_name: str = ""  # configs/NAME.pbtxt instead of config.pbtxt where present
    strict_readiness: bool = True  # ready only while every live model is READY
    model_load_retry_count: int = 0
    exit_timeout_secs: float = 30.0  # in-flight requests' time to finish at stop
    log_warning: bool = True
    log_error: bool = True
    http_header_forward_pattern: str | None = None  # headers -> request parameters
    grpc_header_forward_pattern: str | None = None
    reuse_http_port: bool = False
    reuse_grpc_port: bool = False
    grpc_tls: GrpcTls | None = None
    grpc_options: tuple[tuple[str, int], ...] = ()  # keepalive and HTTP/2 channel arguments
    grpc_compression_level: int = 0  # 0 none ... 3 high (gzip)
    flag_notes: tuple[str, ...] = ()  # one line per given flag that has no effect here
    # Ray: None serves from this process
    ray: RaySettings | None = None
    # Triton's trace extension (--trace-config) and response cache (--cache-config)
    trace: TraceConfig = field(default_factory=TraceConfig)
    response_cache_size: int = 0  # bytes of the local response cache; 0: none

    @property
    def s3_options(self) -> dict[str, object]:
        """Keyword arguments of every S3Storage the manager opens."""
        options: dict[str, object] = {}
        if self.s3_endpoint_url:
            options["endpoint_url"] = self.s3_endpoint_url
        if self.s3_region:
            options["region"] = self.s3_region
        if self.s3_retry is not None:
            options["retry"] = self.s3_retry
        return options


def parse_fraction(value: str) -> float:
    """A fraction in (0, 1] (``--model-load-gpu-limit`` and its variable); ValueError if not."""
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"'{value}' is not a number") from None
    if not 0 < number <= 1:
        raise ValueError(f"{value} is not a fraction in (0, 1]")
    return number


def _variable(environ: Mapping[str, str], name: str) -> str:
    return environ.get(name, "").strip()


def _repositories(locations: list[str]) -> tuple[tuple[Path, ...], tuple[str, ...]]:
    local: list[Path] = []
    remote: list[str] = []
    for location in locations:
        if location.startswith("s3://"):
            remote.append(location)
        elif "://" in location and not location.startswith("file://"):
            raise SettingsError(f"unsupported model repository location '{location}'")
        else:
            path = Path(location.removeprefix("file://")).resolve()
            if not path.is_dir():
                raise SettingsError(f"model repository '{path}' is not a directory")
            local.append(path)
    return tuple(local), tuple(remote)


def _gpu_limit(args: argparse.Namespace, environ: Mapping[str, str]) -> float:
    if args.model_load_gpu_limit is not None:
        return float(args.model_load_gpu_limit)
    variable = _variable(environ, "SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT")
    if not variable:
        return 0.0
    try:
        return parse_fraction(variable)
    except ValueError as exc:
        raise SettingsError(f"SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT: {exc}") from None


def _s3_retry(args: argparse.Namespace) -> RetryPolicy | None:
    if args.s3_retries < 1:
        raise SettingsError("--s3-retries must be at least 1")
    if args.s3_retries == DEFAULT_S3_RETRIES and args.s3_timeout is None:
        return None
    if args.s3_timeout is None:
        return RetryPolicy(attempts=args.s3_retries)
    return RetryPolicy(attempts=args.s3_retries, connect_timeout=args.s3_timeout, read_timeout=args.s3_timeout)


def _sagemaker(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, object]:
    allow = args.allow_sagemaker if args.allow_sagemaker is not None else enabled_by_env(environ)
    port = args.sagemaker_port
    if port is None:
        bind = _variable(environ, "SAGEMAKER_BIND_TO_PORT")
        if bind and not bind.isdigit():
            raise SettingsError(f"SAGEMAKER_BIND_TO_PORT must be a port number, got '{bind}'")
        port = int(bind) if bind else DEFAULT_PORT
    text = args.sagemaker_safe_port_range
    if text is None:
        text = _variable(environ, "SAGEMAKER_SAFE_PORT_RANGE")
    routes = None
    safe = None
    try:
        if allow or args.ray:  # the SageMaker routes are always on the Ray port
            routes = SageMakerSettings.from_env(environ)
            if args.sagemaker_inference_type is not None:
                routes = replace(routes, inference_type=args.sagemaker_inference_type)
        if allow:  # the range only matters to a listener of its own
            safe = parse_port_range(text) if text else None
            check_port(port, safe)
    except InvalidArgumentError as exc:
        raise SettingsError(str(exc)) from None
    return {
        "allow_sagemaker": bool(allow),
        "sagemaker_address": args.sagemaker_address,
        "sagemaker_port": port,
        "sagemaker_safe_port_range": safe,
        "sagemaker": routes,
    }


def _cloudwatch(args: argparse.Namespace, environ: Mapping[str, str]) -> CloudWatchSettings | None:
    """The flags, else ``SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH=true`` with
    ``SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP`` and ``_METRIC_NAMESPACE``."""
    group, namespace = args.cloudwatch_log_group, args.cloudwatch_metric_namespace
    publish = _variable(environ, "SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH").lower()
    if publish not in ("", "true", "false"):
        raise SettingsError(f"SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH must be true or false, got '{publish}'")
    if publish == "true":
        group = group or _variable(environ, "SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP")
        namespace = namespace or _variable(environ, "SAGEMAKER_TRITON_CLOUDWATCH_METRIC_NAMESPACE")
        if not group:
            raise SettingsError("SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH is true but SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP is not set")
        if not namespace:
            raise SettingsError("SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH is true but SAGEMAKER_TRITON_CLOUDWATCH_METRIC_NAMESPACE is not set")
    if not group and not namespace:
        return None
    if not group or not namespace:
        raise SettingsError("--cloudwatch-log-group and --cloudwatch-metric-namespace go together")
    if not args.allow_metrics:
        raise SettingsError("publishing to CloudWatch needs the metrics: --allow-metrics=true (SAGEMAKER_TRITON_ALLOW_METRICS=true)")
    if args.ray:
        raise SettingsError("publishing to CloudWatch is not available with --ray (each replica would publish)")
    return CloudWatchSettings(group, namespace, args.cloudwatch_interval)


def _ray(args: argparse.Namespace) -> RaySettings | None:
    if not args.ray:
        return None
    for flag in ("ray_replicas", "ray_min_replicas", "ray_max_replicas", "ray_max_ongoing_requests"):
        value = getattr(args, flag)
        least = 0 if flag == "ray_min_replicas" else 1
        if value is not None and value < least:
            raise SettingsError(f"--{flag.replace('_', '-')} must be at least {least}, got {value}")
    if args.ray_request_timeout <= 0:
        raise SettingsError("--ray-request-timeout must be positive")
    if args.ray_min_replicas is not None and args.ray_max_replicas is not None and args.ray_min_replicas > args.ray_max_replicas:
        raise SettingsError("--ray-min-replicas is larger than --ray-max-replicas")
    return RaySettings(
        address=args.ray_address,
        num_cpus=args.ray_num_cpus,
        replicas=args.ray_replicas,
        min_replicas=args.ray_min_replicas,
        max_replicas=args.ray_max_replicas,
        target_ongoing_requests=args.ray_target_ongoing_requests,
        max_ongoing_requests=args.ray_max_ongoing_requests,
        replica_cpus=args.ray_replica_cpus,
        request_retries=max(0, args.ray_request_retries),
        request_timeout=args.ray_request_timeout,
        graceful_shutdown_timeout=args.ray_graceful_shutdown_timeout,
    )


#: SageMaker's variables for the Python backend's shared-memory pool (Triton's container turns
#: them into these ``--backend-config=python,...`` keys).
_SAGEMAKER_PYTHON_VARIABLES = {
    "SAGEMAKER_TRITON_SHM_DEFAULT_BYTE_SIZE": "shm-default-byte-size",
    "SAGEMAKER_TRITON_SHM_GROWTH_BYTE_SIZE": "shm-growth-byte-size",
}


def parse_backend_config(option: str) -> tuple[str, str, str]:
    """One ``--backend-config`` value, in Triton's syntax: ``<backend>,<key>=<value>`` or
    ``<key>=<value>`` (a global setting, backend ``""``). ValueError says what is wrong."""
    head, equals, value = option.partition("=")
    if not equals:
        raise ValueError(f"'{option}' is not <backend>,<setting>=<value> or <setting>=<value>")
    backend, comma, key = head.partition(",")
    if not comma:
        backend, key = "", head
    backend, key, value = backend.strip(), key.strip(), value.strip()
    if not key or (comma and not backend):
        raise ValueError(f"'{option}' is not <backend>,<setting>=<value> or <setting>=<value>")
    if backend == "tensorflow" and key == "version" and value not in ("1", "2"):
        raise ValueError(
            f"tensorflow,version={value}: the TensorFlow version is 1 or 2 (Quiver runs "
            "TensorFlow 2 for both; 1 is logged at the first TensorFlow load)"
        )
    return backend, key, value


def _backend_config(options: list[str], environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """``--backend-config`` flags (a later one wins for the same key) over the SageMaker
    variables; the python backend's keys are checked here, so nonsense stops the start."""
    config: dict[str, dict[str, str]] = {}
    for variable, key in _SAGEMAKER_PYTHON_VARIABLES.items():
        value = _variable(environ, variable)
        if value:
            if not value.isdigit():
                raise SettingsError(f"{variable} must be a number of bytes, got '{value}'")
            config.setdefault("python", {})[key] = value
    for option in options:
        try:
            backend, key, value = parse_backend_config(option)
        except ValueError as exc:
            raise SettingsError(f"--backend-config: {exc}") from None
        config.setdefault(backend, {})[key] = value
    try:
        parse_python_settings(config.get("python", {}))
    except InvalidArgumentError as exc:
        raise SettingsError(exc.message) from None
    try:
        check_onnxruntime_settings(config.get("onnxruntime", {}))
        check_onnxruntime_optimized(config.get("onnxruntime", {}))
    except ValueError as exc:
        raise SettingsError(f"--backend-config: {exc}") from None
    return config


def from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """The settings ``quiver serve``'s parsed flags and ``environ`` describe (see the module
    docstring for the precedence); raises SettingsError naming what makes no sense."""
    if args.allow_log_file_api and not args.log_file_dir:
        raise SettingsError("--allow-log-file-api needs --log-file-dir DIR")
    workers = args.frontend_workers
    if workers is None:  # auto
        workers = 0 if args.ray else auto_frontend_workers(usable_cores())
    if workers < 0:
        raise SettingsError(f"--frontend-workers must be 0 or more, got {workers}")
    if workers > 1 and args.ray:
        raise SettingsError("--frontend-workers serve from this process's model side; with --ray, Ray Serve's replicas serve")
    local, remote = _repositories(args.model_repository)
    for flag, specs in (
        ("--http-restricted-api", args.http_restricted_api),
        ("--grpc-restricted-protocol", args.grpc_restricted_protocol),
    ):
        try:
            Restrictions(specs)
        except InvalidArgumentError as exc:
            raise SettingsError(f"{flag}: {exc}") from None
    s3_retry = _s3_retry(args)
    try:
        triton = triton_settings(args)
    except FlagError as exc:
        raise SettingsError(str(exc)) from None
    gpu_limit = _gpu_limit(args, environ)
    sagemaker = _sagemaker(args, environ)
    ray = _ray(args)
    try:
        trace = trace_config.from_args(args, environ)
        cache_size = parse_cache_config(args.cache_config, args.response_cache_byte_size)
    except (TraceConfigError, CacheConfigError) as exc:
        raise SettingsError(str(exc)) from None
    if ray is not None and trace.level:
        # Each replica would sample, count and write the same files on its own.
        raise SettingsError("tracing (--trace-config level=...) is not available with --ray")
    backend_config = _backend_config(args.backend_config, environ)
    triton["flag_notes"] = tuple(triton.get("flag_notes", ())) + tuple(
        f"--backend-config={backend},{key}=... has no effect: Quiver reads no such {backend} backend setting"
        for backend, keys in sorted(backend_config.items())
        if backend not in ("", "python")
        for key in sorted(keys)
        if (backend, key) != ("tensorflow", "version")  # checked: TensorFlow 2 serves 1 and 2
        and not (backend == "onnxruntime" and key in ONNXRUNTIME_KEYS | ONNXRUNTIME_OPTIMIZED_KEYS)
    )
    control_mode = args.model_control_mode or ("on_demand" if args.ray else "none")
    if control_mode == "on_demand":
        # The multi-model endpoint: hundreds of sessions share the process's thread pools
        # rather than each making its own (backends/onnxruntime_threads.py); the flag wins.
        backend_config.setdefault("onnxruntime", {}).setdefault(ONNXRUNTIME_GLOBAL_THREADPOOL, "1")
        # ... and graphs are optimized once per model file, not at every load after an
        # eviction (backends/onnxruntime_optimized.py); the flag wins.
        backend_config["onnxruntime"].setdefault(ONNXRUNTIME_OPTIMIZED_CACHE, "1")
    endpoint = args.s3_endpoint_url or environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or None
    return Settings(
        model_repositories=local,
        s3_repositories=remote,
        http_address=args.http_address,
        http_port=args.http_port,
        grpc_address=args.grpc_address,
        grpc_port=args.grpc_port,
        metrics_address=args.metrics_address,
        metrics_port=args.metrics_port,
        allow_http=args.allow_http,
        allow_grpc=args.allow_grpc,
        allow_metrics=args.allow_metrics,
        allow_cpu_metrics=args.allow_cpu_metrics,
        allow_gpu_metrics=args.allow_gpu_metrics,
        metrics_interval_ms=args.metrics_interval_ms,
        http_max_input_size=args.http_max_input_size,
        frontend_workers=workers,
        grpc_max_message_size=args.grpc_max_message_size,
        grpc_server=args.grpc_server,
        http_restricted_api=tuple(args.http_restricted_api),
        grpc_restricted_protocol=tuple(args.grpc_restricted_protocol),
        **sagemaker,  # type: ignore[arg-type]
        model_control_mode=control_mode,
        load_models=tuple(args.load_model),
        model_memory_limit=args.model_memory_limit or 0,
        model_load_gpu_limit=gpu_limit,
        model_eviction_policy=args.model_eviction_policy,
        model_evict_ahead=args.model_evict_ahead,
        model_load_wait_timeout=args.model_load_wait_timeout,
        repository_poll_secs=args.repository_poll_secs,
        strict_model_config=args.strict_model_config or args.disable_auto_complete_config,
        exit_on_error=args.exit_on_error,
        model_load_thread_count=args.model_load_thread_count,
        inline_execution_threshold_us=args.inline_execution_threshold_us,
        model_namespacing=args.model_namespacing,
        backend_config=backend_config,
        sagemaker_thread_count=args.sagemaker_thread_count or 0,
        model_cache_dir=args.model_cache_dir.resolve() if args.model_cache_dir else None,
        model_cache_size=args.model_cache_size,
        model_archive_max_bytes=args.model_archive_max_bytes or 0,
        model_archive_max_ratio=args.model_archive_max_ratio,
        model_archive_max_files=args.model_archive_max_files,
        model_cache_revalidate_timeout=args.model_cache_revalidate_timeout,
        model_cache_revalidate=args.model_cache_revalidate,
        s3_endpoint_url=endpoint,
        s3_region=args.s3_region or None,
        s3_retry=s3_retry,
        log_verbose=args.log_verbose,
        log_info=args.log_info,
        log_file=args.log_file,
        log_format=args.log_format,
        log_file_dir=args.log_file_dir if args.allow_log_file_api else None,
        cloudwatch=_cloudwatch(args, environ),
        server_id=args.id or "quiver",
        allow_client_shm=args.allow_client_shm,
        **triton,
        ray=ray,
        trace=trace,
        response_cache_size=cache_size,
    )
