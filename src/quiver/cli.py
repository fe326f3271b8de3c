"""``quiver`` command line; ``quiver serve`` mirrors ``tritonserver``'s flags."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import quiver

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{value}'")


def _size(value: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = value.strip().lower().removesuffix("b")
    factor = units.get(text[-1:], 1)
    if factor != 1:
        text = text[:-1]
    try:
        number = int(text) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 64M, got '{value}'") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got '{value}'")
    return number


def _flag(parser: argparse._ActionsContainer, name: str, default: bool, help: str) -> None:
    parser.add_argument(
        name,
        type=_bool,
        nargs="?",
        const=True,
        default=default,
        metavar="true|false",
        help=f"{help} (default: {str(default).lower()})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quiver",
        description=(
            "Quiver: a Triton-compatible inference server. Serves Triton model repositories "
            "(ONNX Runtime, Python and identity backends) over the KServe v2 HTTP protocol, "
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
        "--model-repository",
        "--model-store",
        dest="model_repository",
        action="append",
        required=True,
        type=Path,
        metavar="PATH",
        help="a Triton model repository folder; repeat for several",
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
    net.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default: 8001)")
    net.add_argument("--grpc-address", default="127.0.0.1", help="gRPC bind address (default: 127.0.0.1)")
    net.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port (default: 8002)")
    net.add_argument(
        "--metrics-address", default="127.0.0.1", help="metrics bind address (default: 127.0.0.1)"
    )
    models = serve.add_argument_group("models")
    models.add_argument(
        "--model-control-mode",
        choices=["none"],
        default="none",
        help="'none' loads every model in the repositories at start (default: none)",
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
    logs = serve.add_argument_group("logging")
    logs.add_argument(
        "--log-verbose", type=int, default=0, metavar="LEVEL", help="verbose logging level; >0 logs debug (default: 0)"
    )
    _flag(logs, "--log-info", True, "log lifecycle events")
    return parser


def _configure_logging(verbose: int, info: bool) -> None:
    level = logging.DEBUG if verbose > 0 else (logging.INFO if info else logging.WARNING)
    logging.basicConfig(
        level=level,
        format="%(asctime)s.%(msecs)03d %(levelname).1s %(name)s] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def _run_serve(args: argparse.Namespace) -> int:
    from quiver.runner import Runner, ServerOptions

    options = ServerOptions(
        model_repositories=[p.resolve() for p in args.model_repository],
        http_address=args.http_address,
        http_port=args.http_port,
        grpc_address=args.grpc_address,
        grpc_port=args.grpc_port,
        metrics_address=args.metrics_address,
        metrics_port=args.metrics_port,
        model_control_mode=args.model_control_mode,
        strict_model_config=args.strict_model_config,
        exit_on_error=args.exit_on_error,
        model_load_thread_count=args.model_load_thread_count,
        http_max_input_size=args.http_max_input_size,
        inline_execution_threshold_us=args.inline_execution_threshold_us,
    )
    for path in options.model_repositories:
        if not path.is_dir():
            print(f"quiver: error: model repository '{path}' is not a directory", file=sys.stderr)
            return 2
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(Runner(options).run())
    except OSError as exc:
        logging.getLogger("quiver").error("%s", exc)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "serve":
        _configure_logging(args.log_verbose, args.log_info)
        return _run_serve(args)
    parser.error(f"unknown command {args.command}")
    return 2
