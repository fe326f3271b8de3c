"""``quiver`` command line; ``quiver serve`` mirrors ``tritonserver``'s flags."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import quiver
from quiver import triton_flags
from quiver.cli_types import _bool, _count, _flag, _fraction, _ratio, _seconds, _size, _workers

if TYPE_CHECKING:
    from quiver.settings import Settings

def build_parser() -> argparse.ArgumentParser:
    from quiver.logs import verbose_level
    from quiver.sagemaker_serve import add_parser as add_sagemaker_serve
    from quiver.sagemaker_serve import add_serve_flags

    parser = argparse.ArgumentParser(
        prog="quiver",
        description=(
            "Quiver: a Triton-compatible inference server. Serves Triton model repositories "
            "(ONNX Runtime, Python and identity backends) over the KServe v2 HTTP and gRPC protocols, "
            "with Triton's extensions, so tritonclient works unchanged."
        ),
    )
    parser.add_argument("--version", action="version", version=f"quiver {quiver.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve one or more Triton model repositories",
        description=(
            "Serve Triton model repositories. Flags mirror tritonserver's; boolean flags "
            "take Triton's --flag=true|false form (a bare --flag means true). Stop with "
            "Ctrl-C or SIGTERM: in-flight requests finish, models are finalized, exit code 0."
        ),
    )
    serve.add_argument(
        "--id",
        default="quiver",
        metavar="NAME",
        help="the server's name in its metadata (GET /v2, gRPC ServerMetadata) (default: quiver)",
    )
    serve.add_argument(
        "--model-repository",
        "--model-store",
        dest="model_repository",
        action="append",
        required=True,
        metavar="PATH",
        help=(
            "a Triton model repository: a local folder (model folders, and .tar.gz archives "
            "served by key on demand) or s3://bucket/prefix; repeat for several"
        ),
    )
    net = serve.add_argument_group("listeners (addresses default to 127.0.0.1: pass 0.0.0.0 to serve the network)")
    net.add_argument("--http-port", type=int, default=8000, help="HTTP port; 0 picks a free one (default: 8000)")
    net.add_argument("--http-address", default="127.0.0.1", help="HTTP bind address (default: 127.0.0.1)")
    net.add_argument(
        "--http-max-input-size",
        type=_size,
        default=64 * 1024 * 1024,
        metavar="BYTES",
        help="largest request body accepted, after decompression, e.g. 64M (default: 64M)",
    )
    net.add_argument(
        "--frontend-workers",
        "--http-workers",
        dest="frontend_workers",
        type=_workers,
        default=None,
        metavar="N|auto",
        help="serve HTTP, gRPC and SageMaker from N worker processes accepting on their ports, "
        "each decoding and encoding requests on a core of its own, over this process's one model "
        "table, memory budget, scheduler per model and statistics (metrics stay in this "
        "process); 0 or 1 serves everything from this process; auto: 0 below 4 usable cores "
        "(affinity and cgroup quota), else cores - 2, at most 3 (default: auto)",
    )
    net.add_argument("--grpc-port", type=int, default=8001, help="gRPC port; 0 picks a free one (default: 8001)")
    net.add_argument("--grpc-address", default="127.0.0.1", help="gRPC bind address (default: 127.0.0.1)")
    net.add_argument(
        "--grpc-max-message-size",
        type=_size,
        default=64 * 1024 * 1024,
        metavar="BYTES",
        help=(
            "largest gRPC message received or sent, e.g. 64M; larger gets RESOURCE_EXHAUSTED "
            "(default: 64M)"
        ),
    )
    net.add_argument(
        "--grpc-server",
        choices=("quiver", "grpcio"),
        default="quiver",
        help=(
            "the gRPC server: quiver (Quiver's own HTTP/2 server on the event loop) or grpcio "
            "(grpc.aio's, kept for one release) (default: quiver)"
        ),
    )
    _flag(net, "--allow-http", True, "serve KServe v2 over HTTP")
    _flag(net, "--allow-grpc", True, "serve KServe v2 over gRPC")
    net.add_argument(
        "--allow-sagemaker",
        type=_bool,
        nargs="?",
        const=True,
        default=None,
        metavar="true|false",
        help=(
            "serve the SageMaker container contract (GET /ping, POST /invocations, the "
            "multi-model /models API) on --sagemaker-port (default: true when "
            "SAGEMAKER_MULTI_MODEL or any SAGEMAKER_TRITON_* variable is set, else false)"
        ),
    )
    net.add_argument(
        "--sagemaker-port",
        type=int,
        default=None,
        help="SageMaker port; 0 picks a free one (default: SAGEMAKER_BIND_TO_PORT, else 8080)",
    )
    net.add_argument(
        "--sagemaker-address", default="127.0.0.1", help="SageMaker bind address (default: 127.0.0.1)"
    )
    net.add_argument(
        "--sagemaker-safe-port-range",
        default=None,
        metavar="LOW-HIGH",
        help=(
            "refuse a --sagemaker-port outside this range; port 0 then picks a free port in "
            "it (default: SAGEMAKER_SAFE_PORT_RANGE, else any port)"
        ),
    )
    net.add_argument(
        "--metrics-port", type=int, default=8002, help="Prometheus metrics port (GET /metrics); 0 picks a free one (default: 8002)"
    )
    net.add_argument(
        "--metrics-address", default="127.0.0.1", help="metrics bind address (default: 127.0.0.1)"
    )
    _flag(net, "--allow-metrics", True, "serve Prometheus metrics with Triton's names on --metrics-port")
    _flag(net, "--allow-cpu-metrics", True, "report the machine's CPU utilization and memory")
    _flag(net, "--allow-gpu-metrics", True, "report GPU metrics through NVML (needs quiver[gpu] and a GPU)")
    net.add_argument(
        "--metrics-interval-ms",
        type=lambda value: int(float(value)),
        default=2000,
        metavar="MS",
        help=(
            "CPU, memory and GPU gauges are read when scraped, at most once per this many "
            "milliseconds (a scrape sooner gets the previous reading); model counters are "
            "always current (default: 2000)"
        ),
    )
    net.add_argument(
        "--http-restricted-api",
        action="append",
        default=[],
        metavar="API[,API...]:HEADER=VALUE",
        help=(
            "require HEADER: VALUE on these HTTP API groups (health, metadata, inference, "
            "model-config, model-repository, statistics, logging, trace, shared-memory); "
            "repeatable, e.g. model-repository,logging:admin-key=s3cret"
        ),
    )
    net.add_argument(
        "--grpc-restricted-protocol",
        action="append",
        default=[],
        metavar="API[,API...]:HEADER=VALUE",
        help="the same for gRPC, checked against the call's metadata",
    )
    models = serve.add_argument_group("models")
    models.add_argument(
        "--model-control-mode",
        choices=["none", "explicit", "poll", "on_demand"],
        default=None,
        help=(
            "'none' loads every model at start; 'explicit' loads only --load-model models "
            "and lets the repository API load and unload; 'poll' loads every model and "
            "rescans the repositories every --repository-poll-secs; 'on_demand' is explicit "
            "plus: the first request for a model that is not loaded loads it (default: none; "
            "on_demand with --ray)"
        ),
    )
    models.add_argument(
        "--model-memory-limit",
        type=_size,
        default=None,
        metavar="BYTES",
        help=(
            "host memory for models, e.g. 8G: each model's footprint is measured when it "
            "loads, and the least recently used models not in use are unloaded to make room "
            "(default: no limit)"
        ),
    )
    models.add_argument(
        "--model-load-gpu-limit",
        type=_fraction,
        default=None,
        metavar="FRACTION",
        help=(
            "a model load may not take any GPU's used memory (NVML) past this fraction of its "
            "total, 0 < FRACTION <= 1: models not in use that hold memory there are unloaded "
            "to make room, else the load fails; no effect without a GPU (default: "
            "SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT, else no limit)"
        ),
    )
    models.add_argument(
        "--model-eviction-policy",
        choices=["tinylfu", "lru", "gds", "none"],
        default="tinylfu",
        help="which models go first under --model-memory-limit: tinylfu (W-TinyLFU: keeps "
        "models by how often they are used as well as how recently, per byte, so one-off "
        "requests and scans do not flush often used models), lru (least recently used), "
        "gds (GreedyDual-Size: favours keeping small models), or none (unload nothing: a load "
        "that does not fit fails at once, 507 on SageMaker, whose platform then unloads "
        "models and retries) (default: tinylfu)",
    )
    models.add_argument(
        "--model-evict-ahead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="under --model-memory-limit, after each load unload the eviction policy's "
        "victims in the background until the free bytes would hold another model like it, "
        "so a miss finds its room free instead of waiting for an unload (default: on)",
    )
    _flag(
        models,
        "--model-namespacing",
        True,
        "serve the other models of an archive or SageMaker folder under '<name>::<folder>', "
        "so two of them may each hold a model of one name; when false they keep their own "
        "names and such a clash is refused",
    )
    models.add_argument(
        "--model-load-wait-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="with on_demand, how long a request waits for its model to load before it "
        "gets UNAVAILABLE (the load goes on) (default: 60)",
    )
    models.add_argument(
        "--load-model",
        action="append",
        default=[],
        metavar="NAME",
        help="with --model-control-mode=explicit, a model to load at start; repeat, or '*' for all",
    )
    models.add_argument(
        "--repository-poll-secs",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="with --model-control-mode=poll, seconds between repository scans (default: 15)",
    )
    _flag(
        models,
        "--strict-model-config",
        False,
        "require a complete config.pbtxt; when false, ONNX and Python models get missing "
        "inputs, outputs and max_batch_size from the model itself",
    )
    _flag(
        models,
        "--exit-on-error",
        True,
        "fail start-up when a model fails to load; when false, serve the models that loaded",
    )
    models.add_argument(
        "--model-load-thread-count",
        type=int,
        default=4,
        metavar="N",
        help="models loaded in parallel (default: 4)",
    )
    models.add_argument(
        "--inline-execution-threshold-us",
        type=int,
        default=200,
        metavar="US",
        help=(
            "run an ONNX Runtime instance's executions on the event loop instead of its "
            "thread while they average under this many microseconds: for small models the "
            "thread hand-off costs more than the model; 0 always uses the thread (default: 200)"
        ),
    )
    models.add_argument(
        "--backend-config",
        action="append",
        default=[],
        metavar="<backend>,<setting>=<value>",
        help=(
            "a backend's setting, as tritonserver takes it; repeat for more, or give "
            "<setting>=<value> for a global one. The python backend reads "
            "shm-default-byte-size, shm-growth-byte-size, shm-max-byte-size, "
            "shm-region-prefix-name, stub-timeout-seconds, restart-backoff-seconds, "
            "restart-backoff-max-seconds, spin-microseconds, answer-spin-microseconds (how long the idle "
            "server waits for a quick worker's answer without sleeping, default 300), answer-spin-pressure "
            "(the CPU pressure in percent above which it does not, default 10), worker-queue-depth (requests one "
            "worker holds at once, default 8) and "
            "in-process=true (run Python models in the server's process unless their "
            "config's parameter QUIVER_PYTHON_IN_PROCESS says otherwise); "
            "SAGEMAKER_TRITON_SHM_DEFAULT_BYTE_SIZE and SAGEMAKER_TRITON_SHM_GROWTH_BYTE_SIZE "
            "set the first two when no flag does. The onnxruntime backend reads "
            "enable-global-threadpool, intra_op_thread_count, inter_op_thread_count, "
            "optimized-model-cache (keep each model file's optimized graph in the model cache "
            "after its first load and open that at later loads; default: on in on_demand mode) and "
            "optimized-model-cache-size (bytes, default 4 GiB)"
        ),
    )
    store = serve.add_argument_group(
        "model cache and S3 (credentials, region and endpoint also come from the usual AWS "
        "variables: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL_S3, "
        "AWS_ENDPOINT_URL, AWS_PROFILE)"
    )
    store.add_argument(
        "--model-cache-dir",
        type=Path,
        default=None,
        metavar="PATH",
        help=(
            "where archives and S3 models are downloaded and extracted (default: "
            "$QUIVER_CACHE_DIR, else quiver-model-cache-UID under the system temp folder)"
        ),
    )
    store.add_argument(
        "--model-cache-size",
        type=_size,
        default=20 << 30,
        metavar="BYTES",
        help="bytes of extracted models the disk cache keeps, e.g. 20G; models not loaded go "
        "first, least recently used (default: 20G)",
    )
    store.add_argument(
        "--model-archive-max-bytes",
        type=_size,
        default=None,
        metavar="BYTES",
        help="most bytes one model archive may expand to (its decompressed tar stream, headers "
        "included), checked while extracting; never more than the cache size "
        "(default: --model-cache-size)",
    )
    store.add_argument(
        "--model-archive-max-ratio",
        type=_ratio,
        default=100.0,
        metavar="RATIO",
        help="most times an archive may expand over its compressed size, enforced once it has "
        "expanded past 64M, so decompression bombs stop early; 0 turns it off (default: 100)",
    )
    store.add_argument(
        "--model-archive-max-files",
        type=_count,
        default=100_000,
        metavar="N",
        help="most members (files, folders, links) of one model archive or copied model folder "
        "(default: 100000)",
    )
    store.add_argument(
        "--model-cache-revalidate-timeout",
        type=_seconds,
        default=3.0,
        metavar="SECONDS",
        help="how long a fetch of a model already in the disk cache waits for the store to "
        "confirm it is current (one attempt, apart from --s3-retries and --s3-timeout); past "
        "it, or when the store fails, the cached copy is served with a warning (default: 3)",
    )
    store.add_argument(
        "--model-cache-revalidate",
        choices=("background", "always"),
        default="background",
        help="when an on-demand request loads a model again from the disk cache (it was "
        "evicted from memory), whether the store is asked if the copy is still current: "
        "'background' serves the copy at once and asks meanwhile (a new upload under the same "
        "key is served from the next load on; SageMaker's multi-model endpoints keep serving "
        "their cached copy too); 'always' asks first (one HEAD or LIST per load, bounded by "
        "--model-cache-revalidate-timeout). The first load of a key after start or after an "
        "unload through the API, and loads through the repository API or POST /models, always "
        "ask first (default: background)",
    )
    store.add_argument(
        "--s3-endpoint-url", default=None, metavar="URL",
        help="S3-compatible endpoint (default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS)",
    )  # fmt: skip
    store.add_argument("--s3-region", default=None, metavar="REGION", help="S3 region (default: AWS_REGION)")
    store.add_argument(
        "--s3-retries", type=int, default=5, metavar="N",
        help="attempts per S3 call (backoff with jitter between them) before UNAVAILABLE (default: 5)",
    )  # fmt: skip
    store.add_argument(
        "--s3-timeout", type=float, default=None, metavar="SECONDS",
        help="S3 connect and read timeout of one attempt (default: 5 s connect, 30 s read)",
    )  # fmt: skip
    cluster = serve.add_argument_group(
        "Ray cluster (quiver[ray]): serve from Ray Serve replicas, each with its own model "
        "manager, memory budget and disk cache; requests go to a replica holding their model"
    )
    cluster.add_argument(
        "--ray", action="store_true",
        help="deploy on Ray Serve instead of serving from this process: the v2 HTTP and the "
        "SageMaker routes share --http-port (no gRPC or metrics listener)",
    )
    cluster.add_argument(
        "--ray-address", default="", metavar="ADDRESS",
        help="an existing cluster: HOST:PORT of its head, 'auto', or ray://HOST:PORT "
        "(default: start a local cluster)",
    )
    cluster.add_argument(
        "--ray-num-cpus", type=int, default=None, metavar="N",
        help="CPUs of the local cluster Ray starts (default: this machine's)",
    )
    cluster.add_argument(
        "--ray-replicas", type=int, default=1, metavar="N",
        help="replicas when not autoscaling (default: 1)",
    )
    cluster.add_argument(
        "--ray-min-replicas", type=int, default=None, metavar="N",
        help="autoscale between --ray-min-replicas and --ray-max-replicas (either turns autoscaling on)",
    )
    cluster.add_argument("--ray-max-replicas", type=int, default=None, metavar="N", help="see --ray-min-replicas")
    cluster.add_argument(
        "--ray-target-ongoing-requests", type=float, default=2.0, metavar="N",
        help="autoscaling aims at this many requests in flight per replica (default: 2)",
    )
    cluster.add_argument(
        "--ray-max-ongoing-requests", type=int, default=32, metavar="N",
        help="requests one replica takes at once; past it, requests for a model go to another "
        "replica, which loads it too (default: 32)",
    )
    cluster.add_argument(
        "--ray-replica-cpus", type=float, default=1.0, metavar="N",
        help="CPUs Ray reserves for each replica (default: 1)",
    )
    cluster.add_argument(
        "--ray-request-retries", type=int, default=1, metavar="N",
        help="when a replica dies mid-request, retry on another this many times, then answer 503 "
        "(default: 1; a request that crashes its replica would crash the next one too)",
    )
    cluster.add_argument(
        "--ray-request-timeout", type=float, default=300.0, metavar="SECONDS",
        help="Ray Serve's proxy answers 408 to a request not answered in this time, so none waits "
        "forever, not even with no replica able to start (default: 300)",
    )
    cluster.add_argument(
        "--ray-graceful-shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
        help="on scale-in and shutdown a replica takes no new requests and gets this long to "
        "finish the ones in flight (default: 30)",
    )  # fmt: skip
    from quiver import response_cache, tracing

    tracing.config.add_arguments(serve.add_argument_group("trace (Triton's trace extension)"))
    response_cache.add_arguments(serve.add_argument_group("response cache"))
    shm = serve.add_argument_group("shared memory")
    _flag(
        shm,
        "--allow-client-shm",
        False,
        "let clients register and unregister system shared-memory regions "
        "(/v2/systemsharedmemory, gRPC SystemSharedMemory*) and use them for inputs and "
        "outputs; status is always served, as in Triton",
    )
    triton_flags.add_arguments(serve)
    add_serve_flags(serve, net)  # the SageMaker listener's own flags and CloudWatch
    logs = serve.add_argument_group("logging")
    logs.add_argument(
        "--log-verbose",
        type=verbose_level,
        default=0,
        metavar="LEVEL",
        help="verbose logging level, or true|false (1|0); >0 logs debug (default: 0)",
    )
    _flag(logs, "--log-info", True, "log lifecycle events")
    logs.add_argument("--log-file", default="", metavar="PATH", help="log to this file instead of standard error")
    _flag(
        logs,
        "--allow-log-file-api",
        False,
        "let clients of the logging API (POST /v2/logging, gRPC LogSettings) set log_file to a "
        "file inside --log-file-dir; when false, log_file cannot be changed through the API, as "
        "in Triton",
    )
    logs.add_argument(
        "--log-file-dir", default=None, metavar="DIR",
        help="with --allow-log-file-api, the folder the logging API may put log files in "
        "(names relative to it, or absolute inside it; no '..', no symbolic links followed)",
    )  # fmt: skip
    logs.add_argument(
        "--log-format", choices=["default", "ISO8601"], default="default", help="timestamp format (default: default)"
    )
    add_sagemaker_serve(commands)
    return parser


def _run_serve(args: argparse.Namespace) -> int:

    from quiver import settings as server_settings

    try:
        settings = server_settings.from_args(args, os.environ)
    except server_settings.SettingsError as exc:
        print(f"quiver: error: {exc}", file=sys.stderr)
        return 2
    if settings.ray is not None:
        return _run_ray(settings)
    from quiver import profiling
    from quiver.runner import Runner

    profiling.start("server")
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            code = runner.run(Runner(settings).run())
    except OSError as exc:
        logging.getLogger("quiver").error("%s", exc)
        return 1
    if code != 0:
        # A start that failed has closed everything it opened, but grpc.aio can still crash
        # the interpreter's finalization (SIGSEGV) when its server was started and stopped
        # within moments: leave without finalizing, so the exit code is the one we chose.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run_ray(settings: Settings) -> int:
    from quiver.rayserve.launch import run
    from quiver.runner import StartError, configure_logging

    try:
        configure_logging(settings)
    except StartError as exc:
        print(f"quiver: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return run(settings)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "serve":
        return _run_serve(args)
    if args.command == "sagemaker-serve":
        from quiver.sagemaker_serve import run as run_sagemaker_serve

        return run_sagemaker_serve(args, os.environ, build_parser, _run_serve)
    parser.error(f"unknown command {args.command}")
    return 2
