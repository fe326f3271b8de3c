"""The rest of ``tritonserver``'s flags, so a Triton launch script starts Quiver unchanged.

``quiver serve`` defines the flags whose behaviour it has in :mod:`quiver.cli` (listeners,
models, cache, logging, shared memory; ``--model-namespacing``) and
:mod:`quiver.sagemaker_serve` (``--sagemaker-thread-count``). This module adds every other flag of Triton's parser
(``src/command_line_parser.cc``):

- flags Quiver applies: ``--strict-readiness``, ``--disable-auto-complete-config``,
  ``--model-config-name``,
  ``--model-load-retry-count``, ``--exit-timeout-secs``, ``--log-warning``, ``--log-error``,
  ``--http-header-forward-pattern``, ``--grpc-header-forward-pattern``, ``--reuse-http-port``,
  ``--reuse-grpc-port``, the gRPC TLS flags (``--grpc-use-ssl`` ...), keepalive and HTTP/2 ping
  flags, and ``--grpc-infer-response-compression-level``;
- flags that have no effect here (:data:`NO_EFFECT`): accepted, and each one given logs one
  line at start saying why (``notes``).

The trace and response-cache flags (``--trace-*``, ``--cache-*``,
``--response-cache-byte-size``) and ``--backend-config`` belong to those features' own modules.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: flag -> why it has no effect in Quiver (the log line's reason).
NO_EFFECT: dict[str, str] = {
    "--enable-peer-access": "CUDA peer access between GPUs: Quiver runs no CUDA kernels of its own",
    "--http-thread-count": (
        "the HTTP frontend runs on one asyncio event loop per process (large bodies are decoded "
        "and encoded on codec threads); --frontend-workers N serves HTTP, gRPC and SageMaker from N processes"
    ),
    "--grpc-infer-thread-count": "the gRPC frontend runs on the asyncio event loop",
    "--grpc-infer-allocation-pool-size": "the gRPC frontend allocates responses as it needs them",
    "--grpc-max-response-pool-size": "the gRPC frontend allocates responses as it needs them",
    "--allow-vertex-ai": "Quiver has no Vertex AI frontend",
    "--vertex-ai-port": "Quiver has no Vertex AI frontend",
    "--vertex-ai-thread-count": "Quiver has no Vertex AI frontend",
    "--vertex-ai-default-model": "Quiver has no Vertex AI frontend",
    "--metrics-config": (
        "Quiver's metrics (Triton's counters, gauges and summaries, see the README) are not "
        "configurable"
    ),
    "--rate-limit": "Quiver has no rate limiter: a model instance executes as soon as it is free",
    "--rate-limit-resource": "Quiver has no rate limiter",
    "--pinned-memory-pool-byte-size": "Quiver keeps no pinned-memory pool (no CUDA copies)",
    "--cuda-memory-pool-byte-size": "Quiver keeps no CUDA memory pool (the frameworks allocate their own)",
    "--cuda-virtual-address-size": "Quiver keeps no CUDA memory pool (the frameworks allocate their own)",
    "--min-supported-compute-capability": "Quiver checks no GPU compute capability",
    "--buffer-manager-thread-count": "Quiver has no buffer manager threads",
    "--host-policy": "Quiver has no host policies (NUMA placement)",
    "--backend-directory": "Quiver's backends are built in (Python modules), not shared libraries",
    "--repoagent-directory": "Quiver has no repository agents",
}

#: Flags whose value is a list (Triton allows them several times).
_REPEATABLE = {"--metrics-config", "--rate-limit-resource", "--host-policy"}
_BOOLEAN = {"--enable-peer-access", "--allow-vertex-ai"}
_INTEGER = {
    "--http-thread-count", "--grpc-infer-thread-count", "--grpc-infer-allocation-pool-size",
    "--grpc-max-response-pool-size", "--vertex-ai-port",
    "--vertex-ai-thread-count", "--buffer-manager-thread-count",
}  # fmt: skip

#: --grpc-infer-response-compression-level -> grpc's compression level (0: none ... 3: high).
COMPRESSION_LEVELS = {"none": 0, "low": 1, "medium": 2, "high": 3}

#: --grpc-* flag -> the grpc channel argument it sets.
GRPC_ARGUMENTS = {
    "--grpc-keepalive-time": "grpc.keepalive_time_ms",
    "--grpc-keepalive-timeout": "grpc.keepalive_timeout_ms",
    "--grpc-keepalive-permit-without-calls": "grpc.keepalive_permit_without_calls",
    "--grpc-http2-max-pings-without-data": "grpc.http2.max_pings_without_data",
    "--grpc-http2-min-recv-ping-interval-without-data": "grpc.http2.min_ping_interval_without_data_ms",
    "--grpc-http2-max-ping-strikes": "grpc.http2.max_ping_strikes",
    "--grpc-max-connection-age": "grpc.max_connection_age_ms",
    "--grpc-max-connection-age-grace": "grpc.max_connection_age_grace_ms",
}


class FlagError(ValueError):
    """A flag value that makes no sense (the message names the flag)."""


@dataclass(frozen=True, slots=True)
class GrpcTls:
    """``--grpc-use-ssl`` and its files, read at start."""

    server_cert: bytes
    server_key: bytes
    root_cert: bytes | None
    mutual: bool


def _bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{value}'")


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not an integer") from None


def _bool_flag(group: argparse._ActionsContainer, name: str, default: bool | None, help: str) -> None:
    shown = "" if default is None else f" (default: {str(default).lower()})"
    group.add_argument(
        name, type=_bool, nargs="?", const=True, default=default, metavar="true|false", help=help + shown
    )


def add_arguments(serve: argparse.ArgumentParser) -> None:
    """Triton's flags that :mod:`quiver.cli` does not define itself."""
    applied = serve.add_argument_group("more of tritonserver's flags")
    _bool_flag(
        applied,
        "--strict-readiness",
        True,
        "GET /v2/health/ready (and gRPC ServerReady) answers ready only while every model in "
        "the repository that is not unloaded is READY; when false, ready once started",
    )
    applied.add_argument(
        "--disable-auto-complete-config",
        action="store_true",
        help="require complete model configurations (as --strict-model-config=true)",
    )
    applied.add_argument(
        "--model-config-name", default="", metavar="NAME",
        help="a model folder's configs/NAME.pbtxt, when it has one, is its configuration "
        "instead of config.pbtxt",
    )  # fmt: skip
    applied.add_argument(
        "--model-load-retry-count", type=_int, default=0, metavar="N",
        help="try a model whose load failed this many more times (default: 0)",
    )  # fmt: skip
    applied.add_argument(
        "--exit-timeout-secs", type=_int, default=30, metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long in-flight requests get to finish (default: 30)",
    )  # fmt: skip
    _bool_flag(applied, "--log-warning", True, "log warnings")
    _bool_flag(applied, "--log-error", True, "log errors")
    for protocol in ("http", "grpc"):
        what = "HTTP headers" if protocol == "http" else "gRPC metadata keys"
        applied.add_argument(
            f"--{protocol}-header-forward-pattern", default=None, metavar="REGEX",
            help=f"{what} matching this regular expression (anywhere in the name) reach the "
            "model as string request parameters",
        )  # fmt: skip
        _bool_flag(
            applied, f"--reuse-{protocol}-port", False,
            f"let several servers listen on the {protocol.upper()} port (SO_REUSEPORT)",
        )  # fmt: skip
    _bool_flag(applied, "--grpc-use-ssl", False, "serve gRPC over TLS (needs --grpc-server-cert and --grpc-server-key)")
    _bool_flag(applied, "--grpc-use-ssl-mutual", False, "serve gRPC over mutual TLS (needs --grpc-root-cert too)")
    for name, what in (
        ("--grpc-server-cert", "the server's certificate chain (PEM)"),
        ("--grpc-server-key", "the server's private key (PEM)"),
        ("--grpc-root-cert", "the certificates that sign client certificates (PEM)"),
    ):
        applied.add_argument(name, type=Path, default=None, metavar="FILE", help=f"for gRPC TLS: {what}")
    for name, argument in GRPC_ARGUMENTS.items():
        if name == "--grpc-keepalive-permit-without-calls":
            _bool_flag(applied, name, None, f"gRPC channel argument {argument}")
        else:
            applied.add_argument(name, type=_int, default=None, metavar="N", help=f"gRPC channel argument {argument}")
    applied.add_argument(
        "--grpc-infer-response-compression-level", choices=list(COMPRESSION_LEVELS), default="none",
        help="compress gRPC responses (gzip) at this level (default: none)",
    )  # fmt: skip
    ignored = serve.add_argument_group(
        "tritonserver flags accepted without effect (each logs why at start)"
    )
    for name, why in NO_EFFECT.items():
        kind: Callable[[str], Any] = _bool if name in _BOOLEAN else _int if name in _INTEGER else str
        ignored.add_argument(
            name,
            type=kind,
            default=None,
            action="append" if name in _REPEATABLE else "store",
            metavar="true|false" if name in _BOOLEAN else "N" if name in _INTEGER else "VALUE",
            help=f"no effect: {why}",
        )


def notes(args: argparse.Namespace) -> tuple[str, ...]:
    """One log line for each flag given that has no effect."""
    out = []
    for name, why in NO_EFFECT.items():
        if getattr(args, name[2:].replace("-", "_"), None) is not None:
            out.append(f"{name} has no effect: {why}")
    return tuple(out)


def _pattern(args: argparse.Namespace, flag: str) -> str | None:
    value: str | None = getattr(args, flag[2:].replace("-", "_"))
    if value is None or value == "":
        return None
    try:
        re.compile(value)
    except re.error as exc:
        raise FlagError(f"{flag}: '{value}' is not a regular expression: {exc}") from None
    return value


def _tls(args: argparse.Namespace) -> GrpcTls | None:
    if not (args.grpc_use_ssl or args.grpc_use_ssl_mutual):
        return None
    files: dict[str, bytes | None] = {}
    for flag in ("--grpc-server-cert", "--grpc-server-key", "--grpc-root-cert"):
        path: Path | None = getattr(args, flag[2:].replace("-", "_"))
        if path is None:
            needed = flag != "--grpc-root-cert" or args.grpc_use_ssl_mutual
            if needed:
                raise FlagError(f"{flag} is needed with --grpc-use-ssl" + ("-mutual" if flag == "--grpc-root-cert" else ""))
            files[flag] = None
            continue
        try:
            files[flag] = path.read_bytes()
        except OSError as exc:
            raise FlagError(f"{flag}: cannot read '{path}': {exc.strerror}") from None
    cert, key = files["--grpc-server-cert"], files["--grpc-server-key"]
    assert cert is not None and key is not None
    return GrpcTls(cert, key, files["--grpc-root-cert"], bool(args.grpc_use_ssl_mutual))


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~quiver.settings.Settings` fields these flags set (FlagError names a bad one)."""
    if args.model_load_retry_count < 0:
        raise FlagError("--model-load-retry-count must be at least 0")
    if args.exit_timeout_secs < 0:
        raise FlagError("--exit-timeout-secs must be at least 0")
    grpc_options: list[tuple[str, int]] = []
    for flag, argument in GRPC_ARGUMENTS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            if int(value) < 0:
                raise FlagError(f"{flag} must be at least 0")
            grpc_options.append((argument, int(value)))
    if args.model_config_name and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", args.model_config_name):
        raise FlagError(
            f"--model-config-name '{args.model_config_name}' must be a plain name (letters, "
            "digits, '_', '.', '-')"
        )
    return {
        "model_config_name": args.model_config_name,
        "strict_readiness": args.strict_readiness,
        "model_load_retry_count": args.model_load_retry_count,
        "exit_timeout_secs": float(args.exit_timeout_secs),
        "log_warning": args.log_warning,
        "log_error": args.log_error,
        "http_header_forward_pattern": _pattern(args, "--http-header-forward-pattern"),
        "grpc_header_forward_pattern": _pattern(args, "--grpc-header-forward-pattern"),
        "reuse_http_port": args.reuse_http_port,
        "reuse_grpc_port": args.reuse_grpc_port,
        "grpc_tls": _tls(args),
        "grpc_options": tuple(grpc_options),
        "grpc_compression_level": COMPRESSION_LEVELS[args.grpc_infer_response_compression_level],
        "flag_notes": notes(args),
    }


__all__ = ["COMPRESSION_LEVELS", "GRPC_ARGUMENTS", "NO_EFFECT", "FlagError", "GrpcTls", "add_arguments", "notes", "settings"]
