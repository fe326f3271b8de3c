"""``quiver sagemaker-serve``: the SageMaker container's entrypoint (``serve`` in the image).

It does what Triton's image's ``docker/sagemaker/serve`` script does: reads the
``SAGEMAKER_*`` variables the platform and the user set, checks them (an invalid value fails
at start, exit 1, with a message naming the variable), turns them into ``quiver serve``
flags, and starts the server with them:

- always: the SageMaker listener on, the KServe v2 HTTP listener off, explicit model control;
  gRPC and metrics off unless ``SAGEMAKER_TRITON_ALLOW_GRPC`` / ``_ALLOW_METRICS`` say
  ``true``; listeners bind every address (it runs in a container);
- single-model mode (the default): the repository is ``/opt/ml/model``; it must hold model
  folders, not a model (no top-level config.pbtxt); ``SAGEMAKER_TRITON_DEFAULT_MODEL_NAME``
  names the model (or the ensemble) to load, and may be left out when there is one folder;
  ping mode ``ready``;
- multi-model mode (``SAGEMAKER_MULTI_MODEL=true``): an empty repository
  (``/tmp/sagemaker``), the platform loads each model with ``POST /models`` from the folder
  it extracted (``/opt/ml/models/<hash>/model``); ping mode ``live``; a memory budget of
  80 % of the container's memory (:func:`model_memory_default`), and a load that does not fit
  answers 507 rather than unloading other models (``--model-eviction-policy=none``): the
  platform chooses what to unload;
- ``SAGEMAKER_TRITON_ADDITIONAL_ARGS``: more ``quiver serve`` flags (Triton's names), split
  as a shell would and parsed by the same parser, after the generated ones (so they win).

:func:`plan` decides (no side effects); :func:`run` prints what it decided and serves. The
model roots are options (``--model-root``, ``--multi-model-repository``) so that tests and
local runs need no ``/opt/ml``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from quiver.errors import InvalidArgumentError

# The command line imports this module to list the command: what it needs of the server's
# modules is imported when it runs.

#: Where SageMaker puts the model of a single-model endpoint.
SINGLE_MODEL_ROOT = Path("/opt/ml/model")
#: The empty repository of multi-model mode (the platform names each model's folder).
MULTI_MODEL_REPOSITORY = Path("/tmp/sagemaker")
#: The python backend's shared memory, as Triton's image sets it (16 MiB, growing by 1 MiB).
SHM_DEFAULT_BYTE_SIZE = 16 * 1024 * 1024
SHM_GROWTH_BYTE_SIZE = 1024 * 1024
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


class EntrypointError(Exception):
    """The variables or the model folder make no sense; the message says why (exit 1)."""


@dataclass(slots=True)
class Plan:
    """What the entrypoint decided: ``quiver serve``'s arguments, the variables the server
    reads (the ping mode, single-model mode's model), and the notes printed before it starts."""

    args: list[str]
    environ: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    multi_model: bool = False

    @property
    def command(self) -> str:
        return shlex.join(["quiver", "serve", *self.args])


def _get(env: Mapping[str, str], name: str) -> str:
    return env.get(name, "").strip()


def _boolean(env: Mapping[str, str], name: str, default: bool | None = None) -> bool | None:
    value = _get(env, name)
    if not value:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise EntrypointError(f"{name} must be true or false, got '{value}'")


def _bool_text(value: bool) -> str:
    return "true" if value else "false"


def _integer(env: Mapping[str, str], name: str, *, least: int, most: int | None = None) -> int | None:
    value = _get(env, name)
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        raise EntrypointError(f"{name} must be an integer, got '{value}'") from None
    if number < least or (most is not None and number > most):
        bounds = f"between {least} and {most}" if most is not None else f"at least {least}"
        raise EntrypointError(f"{name} must be {bounds}, got '{value}'")
    return number


def _ping_mode(env: Mapping[str, str], default: str) -> str:
    for name in ("SAGEMAKER_TRITON_OVERRIDE_PING_MODE", "SAGEMAKER_TRITON_PING_MODE"):
        value = _get(env, name)
        if value:
            if value not in ("ready", "live"):
                raise EntrypointError(f"{name} must be 'ready' or 'live', got '{value}'")
            return value
    return default


def plan(
    env: Mapping[str, str],
    *,
    model_root: Path = SINGLE_MODEL_ROOT,
    multi_model_repository: Path = MULTI_MODEL_REPOSITORY,
) -> Plan:
    """The ``quiver serve`` arguments ``env`` (the ``SAGEMAKER_*`` variables) asks for, as
    Triton's ``serve`` script builds tritonserver's; EntrypointError naming the variable (or
    the folder) that makes no sense. Reads ``model_root`` in single-model mode."""
    from quiver.frontends.sagemaker import INFERENCE_TYPES, parse_port_range
    from quiver.settings import parse_fraction

    multi = _boolean(env, "SAGEMAKER_MULTI_MODEL", False)
    notes: list[str] = []
    repository = multi_model_repository if multi else model_root
    ping = _ping_mode(env, "live" if multi else "ready")
    if multi:
        notes.append(f'Quiver is running in SageMaker MME mode. Using ping mode: "{ping}"')
    args = [
        "--allow-sagemaker=true",
        "--allow-http=false",
        "--model-control-mode=explicit",
        f"--model-repository={repository}",
        "--sagemaker-address=0.0.0.0",
    ]
    if multi:
        args.append("--model-eviction-policy=none")
        memory = model_memory_default()
        if memory:
            args.append(f"--model-memory-limit={memory}")
        cache = model_cache_default(env)
        if cache:
            args.append(f"--model-cache-size={cache}")
    # Triton's script passes this variable's value through as --model-namespacing, and AWS's
    # reference documents it so ("set to true by default"): `false` turns namespacing off.
    # Quiver does the same, so an endpoint moved from Triton's image behaves alike.
    namespacing = _boolean(env, "SAGEMAKER_TRITON_DISABLE_MODEL_NAMESPACING", True)
    args.append(f"--model-namespacing={_bool_text(bool(namespacing))}")
    port = _integer(env, "SAGEMAKER_BIND_TO_PORT", least=0, most=65535)
    if port is not None:
        args.append(f"--sagemaker-port={port}")
    safe = _get(env, "SAGEMAKER_SAFE_PORT_RANGE")
    if safe:
        try:
            parse_port_range(safe)
        except InvalidArgumentError as exc:
            raise EntrypointError(f"SAGEMAKER_SAFE_PORT_RANGE: {exc}") from None
        args.append(f"--sagemaker-safe-port-range={safe}")
    grpc = _boolean(env, "SAGEMAKER_TRITON_ALLOW_GRPC", False)
    args += [f"--allow-grpc={_bool_text(bool(grpc))}", "--grpc-address=0.0.0.0"]
    metrics = _boolean(env, "SAGEMAKER_TRITON_ALLOW_METRICS", False)
    args += [f"--allow-metrics={_bool_text(bool(metrics))}", "--metrics-address=0.0.0.0"]
    for variable, flag in (
        ("SAGEMAKER_TRITON_METRICS_PORT", "--metrics-port"),
        ("SAGEMAKER_TRITON_GRPC_PORT", "--grpc-port"),
    ):
        number = _integer(env, variable, least=0, most=65535)
        if number is not None:
            args.append(f"{flag}={number}")
    buffers = _integer(env, "SAGEMAKER_TRITON_BUFFER_MANAGER_THREAD_COUNT", least=0)
    if buffers is not None:
        args.append(f"--buffer-manager-thread-count={buffers}")
    threads = _integer(env, "SAGEMAKER_TRITON_THREAD_COUNT", least=1)
    if threads is not None:
        args.append(f"--sagemaker-thread-count={threads}")
    args += _logging(env)
    args += _backend_configs(env)
    gpu = _get(env, "SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT")
    if gpu:
        try:
            parse_fraction(gpu)
        except ValueError as exc:
            raise EntrypointError(f"SAGEMAKER_TRITON_MODEL_LOAD_GPU_LIMIT: {exc}") from None
        args.append(f"--model-load-gpu-limit={gpu}")
    args += _cloudwatch(env, bool(metrics))
    extra = _get(env, "SAGEMAKER_TRITON_ADDITIONAL_ARGS")
    if not multi and (model_root / "config.pbtxt").is_file():
        raise EntrypointError(
            "Incorrect directory structure.\n"
            "       Model directory needs to contain the top level folder"
        )
    kind = _get(env, "SAGEMAKER_TRITON_INFERENCE_TYPE")
    if kind:
        if kind not in INFERENCE_TYPES:
            raise EntrypointError(
                f"Invalid SAGEMAKER_TRITON_INFERENCE_TYPE '{kind}'\n"
                f"       Must be one of: {', '.join(INFERENCE_TYPES)}"
            )
        args.append(f"--sagemaker-inference-type={kind}")
    environ = {"SAGEMAKER_TRITON_PING_MODE": ping}
    if not multi:
        model = _default_model(env, model_root, notes)
        args.append(f"--load-model={model}")
        environ["SAGEMAKER_TRITON_DEFAULT_MODEL_NAME"] = model  # exported, as the script does
    if extra:
        try:
            args += shlex.split(extra)
        except ValueError as exc:
            raise EntrypointError(f"SAGEMAKER_TRITON_ADDITIONAL_ARGS cannot be split: {exc}") from None
    return Plan(args, environ, notes, bool(multi))


#: Multi-model mode's default memory budget: this share of the container's memory (the rest
#: is the process, the frameworks and the requests' tensors).
MEMORY_SHARE = 0.8
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def model_memory_default() -> int:
    """Multi-model mode's ``--model-memory-limit`` (``SAGEMAKER_TRITON_ADDITIONAL_ARGS`` may
    set another): :data:`MEMORY_SHARE` of the container's memory (its cgroup limit, else the
    machine's), so that a load that would not fit is 507 and the platform unloads models,
    rather than the kernel ending the process. 0 when it cannot be read."""
    import psutil

    total = int(psutil.virtual_memory().total)
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
        break
    return int(total * MEMORY_SHARE)


def model_cache_default(env: Mapping[str, str]) -> int:
    """Multi-model mode's ``--model-cache-size``: the platform's folders are copied into the
    disk cache before they load (no link in them is followed), so the cache may use
    :data:`MEMORY_SHARE` of the free space where it lives (``QUIVER_CACHE_DIR``, else the
    temporary folder) rather than a fixed 20G: a large model fits, and a full disk is 507.
    0 when it cannot be read."""
    import shutil
    import tempfile

    folder = Path(env.get("QUIVER_CACHE_DIR") or tempfile.gettempdir())
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return 0
    return int(free * MEMORY_SHARE) if free > 0 else 0


def _logging(env: Mapping[str, str]) -> list[str]:
    """Triton's image logs verbosely unless ``SAGEMAKER_TRITON_LOG_VERBOSE`` says otherwise."""
    verbose = _get(env, "SAGEMAKER_TRITON_LOG_VERBOSE") or "true"
    if verbose.lower() not in _TRUE + _FALSE and not verbose.isdigit():
        raise EntrypointError(
            f"SAGEMAKER_TRITON_LOG_VERBOSE must be true, false or a level (0, 1, ...), got '{verbose}'"
        )
    args = [f"--log-verbose={verbose}"]
    for level in ("INFO", "WARNING", "ERROR"):
        value = _boolean(env, f"SAGEMAKER_TRITON_LOG_{level}")
        if value is not None:
            args.append(f"--log-{level.lower()}={_bool_text(value)}")
    return args


def _backend_configs(env: Mapping[str, str]) -> list[str]:
    """The python backend's shared memory (always, with Triton's image's defaults) and the
    TensorFlow version, as ``--backend-config`` flags."""
    from quiver.settings import parse_backend_config

    args = []
    for variable, setting, default in (
        ("SAGEMAKER_TRITON_SHM_DEFAULT_BYTE_SIZE", "shm-default-byte-size", SHM_DEFAULT_BYTE_SIZE),
        ("SAGEMAKER_TRITON_SHM_GROWTH_BYTE_SIZE", "shm-growth-byte-size", SHM_GROWTH_BYTE_SIZE),
    ):
        size = _integer(env, variable, least=1)
        args.append(f"--backend-config=python,{setting}={default if size is None else size}")
    version = _get(env, "SAGEMAKER_TRITON_TENSORFLOW_VERSION")
    if version:
        text = f"tensorflow,version={version}"
        try:
            parse_backend_config(text)
        except ValueError as exc:
            raise EntrypointError(f"SAGEMAKER_TRITON_TENSORFLOW_VERSION: {exc}") from None
        args.append(f"--backend-config={text}")
    return args


def _cloudwatch(env: Mapping[str, str], metrics: bool) -> list[str]:
    """``SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH=true``: the log group and namespace
    are required, and so are the metrics (``SAGEMAKER_TRITON_ALLOW_METRICS=true``)."""
    if not _boolean(env, "SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH", False):
        return []
    group = _get(env, "SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP")
    namespace = _get(env, "SAGEMAKER_TRITON_CLOUDWATCH_METRIC_NAMESPACE")
    for name, value in (
        ("SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP", group),
        ("SAGEMAKER_TRITON_CLOUDWATCH_METRIC_NAMESPACE", namespace),
    ):
        if not value:
            raise EntrypointError(
                f"{name} is required when SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH is true"
            )
    if not metrics:
        raise EntrypointError(
            "SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH=true publishes Triton's metrics: "
            "set SAGEMAKER_TRITON_ALLOW_METRICS=true too"
        )
    return [f"--cloudwatch-log-group={group}", f"--cloudwatch-metric-namespace={namespace}"]


def _default_model(env: Mapping[str, str], root: Path, notes: list[str]) -> str:
    """Single-model mode's model: the one ``SAGEMAKER_TRITON_DEFAULT_MODEL_NAME`` names (its
    folder must exist), else the only folder of ``root``."""
    from quiver.repository.names import check_model_name

    name = _get(env, "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME")
    if name:
        try:
            check_model_name(name)
        except InvalidArgumentError as exc:
            raise EntrypointError(f"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME: {exc}") from None
        folder = root / name
        if not folder.is_dir() or folder.is_symlink():
            raise EntrypointError(
                f"Directory with provided SAGEMAKER_TRITON_DEFAULT_MODEL_NAME {name} does not exist"
            )
        return name
    try:
        folders = sorted(e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False))
    except OSError as exc:
        raise EntrypointError(f"cannot read the model folder {root}: {exc.strerror}") from None
    if not folders:
        raise EntrypointError("No model found in model repository")
    if len(folders) > 1:
        raise EntrypointError(
            "More than 1 model directory found in model repository.\n"
            "       Either provide a single directory or set SAGEMAKER_TRITON_DEFAULT_MODEL_NAME "
            "to run the ensemble backend.\n"
            f"       Directories found in model repository: {' '.join(folders)}"
        )
    notes.append(
        "WARNING: No SAGEMAKER_TRITON_DEFAULT_MODEL_NAME provided.\n"
        f"         Starting with the only existing model directory {folders[0]}"
    )
    return folders[0]


# -- the command -------------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "sagemaker-serve",
        help="the SageMaker container's entrypoint: serve as SAGEMAKER_* variables say",
        description=(
            "Start Quiver as Triton's SageMaker image starts tritonserver: the SAGEMAKER_* "
            "variables (see the README's SageMaker section) become quiver serve flags, "
            "checked first; SAGEMAKER_TRITON_ADDITIONAL_ARGS adds more. Single-model mode "
            "serves a model folder of --model-root; SAGEMAKER_MULTI_MODEL=true serves what "
            "the platform loads with POST /models."
        ),
    )
    parser.add_argument(
        "--model-root",
        type=Path,
        default=SINGLE_MODEL_ROOT,
        metavar="PATH",
        help=f"single-model mode's model repository (default: {SINGLE_MODEL_ROOT})",
    )
    parser.add_argument(
        "--multi-model-repository",
        type=Path,
        default=MULTI_MODEL_REPOSITORY,
        metavar="PATH",
        help=(
            "multi-model mode's (empty) repository, created when missing; the platform's "
            f"folders are named by POST /models (default: {MULTI_MODEL_REPOSITORY})"
        ),
    )
    parser.add_argument(
        "--print-command",
        action="store_true",
        help="print the quiver serve command the variables make, and exit",
    )


def add_serve_flags(serve: argparse.ArgumentParser, net: argparse._ArgumentGroup) -> None:
    """``quiver serve``'s flags for the SageMaker listener (in ``net``, the listeners' group)
    and for CloudWatch publishing (a group of their own)."""
    from quiver.cli_types import _count, _seconds

    net.add_argument(
        "--sagemaker-thread-count",
        type=_count,
        default=None,
        metavar="N",
        help=(
            "threads that decode and encode large request and response bodies off the event "
            "loop (Triton: the SageMaker listener's threads) (default: 4, at most the CPUs)"
        ),
    )
    net.add_argument(
        "--sagemaker-inference-type",
        choices=["infer", "generate", "generate_stream"],
        default=None,
        help=(
            "what POST /invocations does: KServe v2 inference, or the generate extension "
            "(default: SAGEMAKER_TRITON_INFERENCE_TYPE, else infer)"
        ),
    )
    cloud = serve.add_argument_group(
        "CloudWatch (quiver[sagemaker]): publish the metrics as embedded-metric-format events "
        "into a CloudWatch Logs group, as the CloudWatch agent does from Prometheus; needs "
        "--allow-metrics; credentials, region and endpoint from the usual AWS variables "
        "(AWS_REGION, AWS_ENDPOINT_URL_CLOUDWATCH_LOGS, ...)"
    )
    cloud.add_argument(
        "--cloudwatch-log-group", default=None, metavar="GROUP",
        help="publish into this log group, created when missing (default: "
        "SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP when SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH "
        "is true, else no publishing)",
    )
    cloud.add_argument(
        "--cloudwatch-metric-namespace", default=None, metavar="NAMESPACE",
        help="the metric namespace of the events (default: SAGEMAKER_TRITON_CLOUDWATCH_METRIC_NAMESPACE)",
    )
    cloud.add_argument(
        "--cloudwatch-interval", type=_seconds, default=60.0, metavar="SECONDS",
        help="seconds between publications (default: 60)",
    )  # fmt: skip


def parse_serve_args(
    build_parser: Callable[[], argparse.ArgumentParser], entry: Plan
) -> argparse.Namespace:
    """``quiver serve``'s parser over the plan's arguments; EntrypointError when they do
    not parse (the additional arguments are the user's: named as such)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return build_parser().parse_args(["serve", *entry.args])
    except SystemExit:
        message = captured.getvalue().strip().splitlines()
        reason = message[-1] if message else "invalid arguments"
        reason = reason.split("error: ", 1)[-1]
        raise EntrypointError(
            f"the server's arguments do not parse ({reason}); SAGEMAKER_TRITON_ADDITIONAL_ARGS "
            f"is parsed as quiver serve's (Triton's) flags: {entry.command}"
        ) from None


def run(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    build_parser: Callable[[], argparse.ArgumentParser],
    run_serve: Callable[[argparse.Namespace], int],
) -> int:
    """Decide, print the decision, then serve (in this process) with it."""
    try:
        entry = plan(
            environ,
            model_root=args.model_root,
            multi_model_repository=args.multi_model_repository,
        )
        serve_args = parse_serve_args(build_parser, entry)
    except EntrypointError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return 1
    if args.print_command:
        print(entry.command)
        return 0
    for note in entry.notes:
        print(note, file=sys.stderr)
    if entry.multi_model:
        try:
            args.multi_model_repository.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"ERROR: cannot create {args.multi_model_repository}: {exc.strerror}", file=sys.stderr)
            return 1
    print(f"SageMaker entrypoint: {entry.command}", file=sys.stderr, flush=True)
    os.environ.update(entry.environ)  # as the script exports them
    return run_serve(serve_args)


__all__ = [
    "MULTI_MODEL_REPOSITORY",
    "SINGLE_MODEL_ROOT",
    "EntrypointError",
    "Plan",
    "add_parser",
    "add_serve_flags",
    "parse_serve_args",
    "plan",
    "run",
]
