"""CPU per request of the server's own code: the HTTP protocol, the v2 app, the service, the
scheduler and the model, in one process with no sockets.

Run: ``.venv/bin/python -m benchmarks.request_path --src before=DIR --src after=DIR`` from the
repository root; ``--help`` for options.

``benchmarks/request_cpu.py`` measures what a request costs a real server under load, kernel
and wake-ups included; on a shared two-core machine that number moves by 20% from one trial to
the next (the kernel's share and the wake-ups change with the load, and with how often the
server waits for its client). This benchmark takes the kernel out: a child process per variant
(``--src NAME=DIR``: the ``src`` folder of a checkout, first on its ``PYTHONPATH``) assembles the
server as ``quiver serve`` does (``runner.assemble``, the models loaded), connects the
checkout's HTTP protocol to a transport that only collects what is written, and feeds it
complete requests (the bytes ``benchmarks/loadgen.py`` sends) one after another on one
keep-alive connection, each answered before the next. The process's CPU time per request is
one sample (a round of ``--requests``); variants alternate round by round and the table gives
the best and the median round, and the ratio of each variant to the first.

The HTTP protocol is the checkout's own: ``frontends/http_server.py`` when it has one, else
uvicorn's httptools protocol as ``frontends/asgi.py`` configured it. ``--encodings grpc``
drives the checkout's gRPC servicer the same way: its ``ModelInfer`` handler called with the
serialized ``ModelInferRequest`` ``benchmarks/loadgen.py`` sends, one call after another, with
``grpc.aio`` itself taken out (what is left is Quiver's own gRPC code and everything behind it).
``--encodings binary-linked`` (or ``json-linked``) takes the way a frontend worker serves
(``--frontend-workers``): the worker's HTTP code, the link to the model side over a Unix socket
pair in the same process, the model side's handling of the linked request, and back; both
ends' code in one process, the link's system calls included, no process wake-ups.

Results: a markdown table on stdout and in ``benchmarks/results/request_path.md``, the same as
JSON in ``request_path.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import ROOT

MODELS = ("onnx", "simple", "python")
ENCODINGS = ("binary", "json", "grpc", "binary-linked", "json-linked")


class _Transport:
    """Collects what the protocol writes; wakes the driver when a whole answer is in."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.want: int | None = None
        self.waiter: asyncio.Future[None] | None = None

    def write(self, data: bytes) -> None:
        self.data += data
        if self.waiter is not None and not self.waiter.done() and self._complete():
            self.waiter.set_result(None)

    def writelines(self, parts: list[bytes]) -> None:
        self.write(b"".join(parts))

    def _complete(self) -> bool:
        end = self.data.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(self.data[:end]).lower()
        start = head.find(b"content-length:")
        length = int(head[start + 15 :].split(b"\r\n", 1)[0]) if start >= 0 else 0
        return len(self.data) >= end + 4 + length

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)


def _protocol(app: Any, loop: asyncio.AbstractEventLoop) -> Any:
    try:
        from quiver.frontends.http_server import HttpProtocol, HttpServer  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # a checkout from before Quiver's own server: uvicorn, as asgi.py set it up
        import uvicorn
        from uvicorn.server import ServerState

        from quiver.frontends.asgi import ChunkCountingProtocol  # type: ignore[attr-defined,unused-ignore]

        config = uvicorn.Config(app, interface="asgi3", log_config=None, access_log=False, lifespan="off",
                                proxy_headers=False, server_header=False, date_header=False)
        config.load()
        return ChunkCountingProtocol(config, ServerState(), {})
    server = HttpServer(app)
    server.loop = loop
    return HttpProtocol(server)


def _sender(protocol: Any, request: bytes) -> Callable[[], Awaitable[bytes]]:
    """``request`` into ``protocol`` on an in-memory transport, once per call: b"" for a 200,
    else the answer."""
    loop = asyncio.get_running_loop()
    transport = _Transport()
    protocol.connection_made(transport)

    async def one() -> bytes:
        transport.data.clear()
        transport.waiter = loop.create_future()
        protocol.data_received(request)
        await transport.waiter
        return b"" if transport.data.startswith(b"HTTP/1.1 200") else bytes(transport.data) or b"(nothing)"

    return one


def _http_driver(parts: Any, payload: Any, encoding: str) -> Callable[[], Awaitable[bytes]]:
    """One request through the checkout's HTTP protocol: b"" for a 200, else the answer."""
    loop = asyncio.get_running_loop()
    return _sender(_protocol(parts.http.app(), loop), payload.http_request(encoding, "127.0.0.1", 8000))


async def _linked_driver(parts: Any, payload: Any, encoding: str) -> Callable[[], Awaitable[bytes]]:
    """One request through a frontend worker's HTTP path (``--frontend-workers``): the
    checkout's HTTP protocol and ``WorkerFrontend``, the link to the model side over a Unix
    socket pair in this same process, the model side's handling of a linked request
    (``FrontendWorkers``), and back. Both ends' code in one process, the link's two system
    calls each way included, no process wake-ups."""
    import socket as socket_

    from quiver.frontends.http_worker import WorkerFrontend
    from quiver.frontends.remote_service import RemoteService
    from quiver.frontends.restrictions import Restrictions
    from quiver.frontends.worker_link import Link
    from quiver.frontends.workers import FrontendWorkers, _Worker

    loop = asyncio.get_running_loop()
    model_side = FrontendWorkers(parts.service, parts.http.app(), None, 0, max_input_size=1 << 26, restricted_api=[])
    ours, theirs = socket_.socketpair(socket_.AF_UNIX, socket_.SOCK_STREAM)
    holder: list[Any] = []
    _, model_link = await loop.create_unix_connection(
        lambda: Link(lambda m: model_side._on_message(holder[0], m), lambda: None), sock=ours
    )
    holder.append(_Worker(0, None, model_link, loop.create_future(), 0.0))  # type: ignore[arg-type]
    remote = RemoteService()
    _, remote.link = await loop.create_unix_connection(lambda: Link(remote.on_message, remote.on_lost), sock=theirs)
    frontend = WorkerFrontend(remote, max_input_size=1 << 26, restrictions=Restrictions([]))
    return _sender(_protocol(frontend.app(), loop), payload.http_request(encoding.removesuffix("-linked"), "127.0.0.1", 8000))


def _grpc_driver(parts: Any, payload: Any) -> Callable[[], Awaitable[bytes]]:
    """One ``ModelInfer`` through the checkout's gRPC servicer (no grpc.aio): b"" when it
    answered (a failure raises)."""
    from quiver.frontends.grpc import InferenceServicer

    servicer = InferenceServicer(parts.service)
    data = payload.grpc_request().SerializeToString()

    async def one() -> bytes:
        answer: bytes = await servicer.model_infer_bytes(data, None)
        return b"" if answer else b"(an empty ModelInferResponse)"

    return one


async def _child(model: str, encoding: str, requests: int, rounds: int) -> list[float]:
    from benchmarks.request_cpu import PAYLOADS, write_repository
    from quiver import settings as server_settings
    from quiver.cli import build_parser
    from quiver.runner import assemble, load_models

    folder = Path(tempfile.mkdtemp(prefix="request_path-"))
    repository = write_repository(folder, model)
    args = build_parser().parse_args(["serve", "--model-repository", str(repository), "--allow-metrics", "false"])
    settings = server_settings.from_args(args, os.environ)
    parts = assemble(settings)
    await load_models(parts, settings)
    parts.service.ready = True
    payload = PAYLOADS[model]
    if encoding == "grpc":
        one = _grpc_driver(parts, payload)
    elif encoding.endswith("-linked"):
        one = await _linked_driver(parts, payload, encoding)
    else:
        one = _http_driver(parts, payload, encoding)
    problem = await one()
    if problem:
        raise SystemExit(f"{model} {encoding}: {problem[:300]!r}")
    for _ in range(max(1000, requests // 5)):
        await one()
    samples = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(requests):
            await one()
        samples.append(1e6 * (time.process_time() - start) / requests)
    await parts.manager.stop()
    return samples


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", action="append", default=[], metavar="NAME=DIR",
                        help="a server variant: NAME=the src folder of a checkout (repeatable); "
                        "default one variant, 'this', from this checkout")
    parser.add_argument("--models", default="onnx,simple", help=f"of: {','.join(MODELS)}")
    parser.add_argument("--encodings", default="binary,json", help=f"of: {','.join(ENCODINGS)} (gRPC without grpc.aio)")
    parser.add_argument("--requests", type=int, default=5000, help="requests per round")
    parser.add_argument("--repeat", type=int, default=5, help="rounds per variant (alternating)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "ENCODING"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.encodings = [e for e in args.encodings.split(",") if e]
    if set(args.models) - set(MODELS) or set(args.encodings) - set(ENCODINGS):
        parser.error(f"models of {MODELS}, encodings of {ENCODINGS}")
    args.variants = common.source_variants(parser, args.src, ROOT / "src")
    return args


def _run_child(src: str, model: str, encoding: str, requests: int) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(ROOT)]))
    command = [sys.executable, "-m", "benchmarks.request_path", "--child", model, encoding, "--requests", str(requests), "--repeat", "1"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{src} {model} {encoding}: exit {done.returncode}\n{done.stderr[-3000:]}")
    value: float = json.loads(done.stdout.strip().splitlines()[-1])[0]
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        model, encoding = args.child
        samples = common.run_async(_child(model, encoding, args.requests, args.repeat))
        print(json.dumps(samples))
        sys.stdout.flush()
        os._exit(0)  # the model side's threads need not wind down
    samples: dict[tuple[str, str, str], list[float]] = {}
    for round_ in range(args.repeat):
        for model in args.models:
            for encoding in args.encodings:
                for name, src in args.variants.items():
                    us = _run_child(src, model, encoding, args.requests)
                    samples.setdefault((model, encoding, name), []).append(us)
                    print(f"[request_path {time.strftime('%H:%M:%S')}] round {round_ + 1}/{args.repeat} "
                          f"{name} {model} {encoding}: {us:.1f} us/request", file=sys.stderr, flush=True)
    names = list(args.variants)
    head = "| model | encoding | " + " | ".join(f"{n} us/req best (median)" for n in names)
    head += "".join(f" | {n} / {names[0]}" for n in names[1:]) + " |"
    lines = [head, "|---|---|" + "---:|" * (2 * len(names) - 1)]
    rows = []
    for model in args.models:
        for encoding in args.encodings:
            best = {n: min(samples[(model, encoding, n)]) for n in names}
            cells = [f"{best[n]:.1f} ({statistics.median(samples[(model, encoding, n)]):.1f})" for n in names]
            cells += [f"{best[n] / best[names[0]]:.2f}x" for n in names[1:]]
            lines.append(f"| {model} | {encoding} | " + " | ".join(cells) + " |")
            rows += [{"model": model, "encoding": encoding, "variant": n, "samples_us": samples[(model, encoding, n)],
                      "best_us": best[n]} for n in names]
    markdown = "\n".join(lines)
    print(markdown)
    header = (
        "# CPU per request of the server's own code (no sockets)\n\n"
        f"`{common.command_line()}`\n\n"
        f"{args.requests} requests per round, {args.repeat} rounds per variant (alternating), one keep-alive "
        "connection, each request answered before the next; the process's CPU microseconds per request, "
        f"best round (median round). Load average at the end: {os.getloadavg()[0]:.1f}.\n\n"
    )
    report = {"command": common.command_line(), "environment": common.environment(("quiver", "uvicorn", "httptools", "onnxruntime")),
              "settings": {"requests": args.requests, "repeat": args.repeat, "variants": args.variants},
              "load_average": os.getloadavg(), "rows": rows}
    print(common.write_results(args.output_dir, "request_path", header + markdown + "\n", report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
