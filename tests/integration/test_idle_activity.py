"""Every request counts as activity for the idle detector (lifecycle/idle.py), not only
inferences: while clients scrape ``/metrics``, read the repository index or ask whether the
server is ready, with gaps shorter than the lull, configurations are not read ahead.

The server runs in this process (the runner, as ``quiver serve`` assembles it, on real
sockets) so the test can count the configurations read ahead; the clients are real
(``tritonclient`` over HTTP and gRPC, a plain GET for ``/metrics``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import tritonclient.grpc.aio as grpcclient
import tritonclient.http.aio as httpclient

from quiver import runner as runner_module
from quiver.backends import onnxruntime_optimized, onnxruntime_threads
from quiver.cli import build_parser
from quiver.lifecycle.read_ahead import IDLE_S, MAX_LULL_S
from quiver.runner import Runner
from quiver.settings import from_args
from support.s3 import free_ports

#: Enough folders that reading them ahead (two passes, a lull before each) outlasts the test.
FOLDERS = 2500
CONFIG = """name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""
#: How long the clients keep asking, and the gap between their requests (well under the lull).
ASKING_S = 0.4
GAP_S = IDLE_S / 5
#: Windows of requests, at most (the first that passes is enough).
WINDOWS = 3


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("idle")
    for i in range(FOLDERS):
        name = f"m{i:04d}"
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    return repo


Ask = Callable[[], Awaitable[Any]]


async def _asks(kind: str, http: int, grpc: int, metrics: int, stack: list[Any]) -> Ask:
    if kind == "metrics":
        session = aiohttp.ClientSession()
        stack.append(session.close)

        async def scrape() -> None:
            async with session.get(f"http://127.0.0.1:{metrics}/metrics") as response:
                assert response.status == 200
                await response.read()

        return scrape
    if kind.startswith("grpc"):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        stack.append(client.close)
        return client.is_server_ready
    http_client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
    stack.append(http_client.close)
    return http_client.get_model_repository_index if kind.endswith("index") else http_client.is_server_ready


#: The server's flags for a kind of request beside the repository's and the ports.
FLAGS = {"grpcio-ready": ["--grpc-server", "grpcio"], "workers-index": ["--frontend-workers", "2"]}


@pytest.mark.parametrize("kind", ["metrics", "index", "http-ready", "grpc-ready", "grpcio-ready", "workers-index"])
def test_requests_that_are_not_inferences_keep_configurations_from_being_read_ahead(
    repository: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "configure_logging", lambda settings: None)  # the test's logging stays
    monkeypatch.setattr(runner_module, "freeze_heap", lambda why: None)  # nor is the test's heap frozen
    monkeypatch.setattr(runner_module, "raise_open_file_limit", lambda: 0)  # nor its limits and environment
    monkeypatch.setattr(onnxruntime_threads, "_decided", [])  # what this server decides stays its own
    monkeypatch.setattr(onnxruntime_optimized, "_decided", [])
    http, grpc, metrics = free_ports(3)
    argv = [
        "serve", "--model-repository", str(repository), "--model-control-mode=on_demand",
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), *FLAGS.get(kind, []),
        # onnxruntime's global thread pools, once made, are the test process's for good: a later
        # test's plain InferenceSession (per-session threads) would be refused
        "--backend-config=onnxruntime,enable-global-threadpool=0",
        "--backend-config=onnxruntime,optimized-model-cache=0",  # no optimizer process of the test's
    ]
    server = Runner(from_args(build_parser().parse_args(argv), {}))

    async def main() -> tuple[list[tuple[int, int]], int]:
        serving = asyncio.create_task(server.run())
        closers: list[Any] = []
        try:
            while server.parts is None or not server.parts.service.ready:
                assert not serving.done(), "the server stopped at start"
                await asyncio.sleep(0.01)
            read_ahead = server.parts.manager._read_ahead
            assert read_ahead is not None
            ask = await _asks(kind, http, grpc, metrics, closers)
            await ask()  # connected: the clients' own set-up is not in the window
            loop = asyncio.get_running_loop()
            windows: list[tuple[int, int]] = []  # (read ahead, requests) in each window
            for _ in range(WINDOWS):
                before, asked = read_ahead.read, 0
                end = loop.time() + ASKING_S
                while loop.time() < end:
                    await ask()
                    asked += 1
                    await asyncio.sleep(GAP_S)
                windows.append((read_ahead.read - before, asked))
            # nobody asking: configurations are read ahead (the test can fail). After trips that
            # requests came during, the lull a trip waits for may have grown to MAX_LULL_S, so
            # the quiet window starts once reading has (or that long after the last request).
            started, give_up = read_ahead.read, loop.time() + MAX_LULL_S + IDLE_S
            while read_ahead.read == started and loop.time() < give_up:
                await asyncio.sleep(0.005)
            quiet = read_ahead.read
            await asyncio.sleep(ASKING_S)
            return windows, read_ahead.read - quiet
        finally:
            for close in closers:
                await close()
            server.request_stop()
            await asyncio.wait_for(serving, 60)

    windows, quiet = asyncio.run(main())
    assert quiet >= 20, f"only {quiet} configurations read ahead in {ASKING_S} s of quiet"
    # A stall of the test's own loop (its clients share it) over the lull lets a few trips
    # through, rarely many: one window of the three is enough; without the requests counting,
    # reading went on at a quarter of its quiet speed or more in every window.
    said = ", ".join(f"{read} while {asked} came" for read, asked in windows)
    assert min(read for read, _ in windows) <= max(3, quiet // 10), f"'{kind}' requests: {said} (quiet: {quiet})"
