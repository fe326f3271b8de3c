"""``quiver serve`` for every benchmark (:class:`QuiverServer`), and Quiver as a peer of the
comparison (:class:`QuiverPeer`).

Quiver runs from the project's own virtual environment (``.venv``, made by ``make setup``):
the ``quiver`` next to the Python running the benchmark (the project venv's, as the Makefile
runs them), else ``.venv/bin/quiver``; nothing is installed here.

:class:`QuiverServer` is the one way the benchmarks start Quiver::

    with QuiverServer(repository, ["--model-control-mode", "on_demand"], log=folder / "server.log") as server:
        host, port = server.endpoints.address("json")
        ...
    server.exit_code  # what it stopped with after SIGTERM (None: it had to be killed)

It runs ``quiver serve --model-repository REPOSITORY`` with port 0 (the system picks a free
one) for each listener it waits for (``--http-port 0 --grpc-port 0 --metrics-port 0`` by
default) unless the flags give that port, and reads the ports it picked from its log ("started
HTTP service at H:P", "started GRPC service at H:P", "started Metrics service at H:P"); then it
waits for ``/v2/health/ready`` (or ``ready_path``). Everything else is :class:`Server`'s: its
own session, SIGTERM then SIGKILL, stopped at exit.

Two variants of the peer serve the ``tiny`` workload, each from the single-process server or
(``frontend_workers=N``) with ``--frontend-workers N``:

* ``QuiverPeer("python")`` ("quiver (python model)"): the very ``config.pbtxt`` and ``model.py``
  the Triton peer serves (``backend: "python"``, ``TritonPythonModel`` using
  ``triton_python_backend_utils``): Quiver runs Triton Python models unchanged, so the two servers
  run the same model source;
* ``QuiverPeer("onnx")`` ("quiver (onnx model)"): the same function as an ONNX graph (one ``Mul``
  by a constant 2, built with ``onnx.helper``) on ``platform: "onnxruntime_onnx"``, same inputs,
  outputs, ``max_batch_size: 0`` and one CPU instance.

Run this module for a smoke check of both variants over HTTP JSON, HTTP binary and gRPC::

    .venv/bin/python -m benchmarks.peers.quiver
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.peers import ROOT, WORK, Endpoints, Peer, PeerError, Server, smoke, tiny

_BESIDE = Path(sys.executable).parent / "quiver"
QUIVER = _BESIDE if os.access(_BESIDE, os.X_OK) else ROOT / ".venv" / "bin" / "quiver"
HOME = WORK / "quiver"
READY_TIMEOUT = 120.0
BACKENDS = ("python", "onnx")
PORT_FLAGS = {"HTTP": "--http-port", "GRPC": "--grpc-port", "Metrics": "--metrics-port"}

#: The Python model's configuration, served by ONNX Runtime.
ONNX_CONFIG = tiny.PYTHON_CONFIG.replace('backend: "python"', 'platform: "onnxruntime_onnx"')


class QuiverServer(Server):
    """``quiver serve --model-repository REPOSITORY [port 0 per listener] FLAGS``.

    ``listeners``: the listeners to wait for, each given port 0 unless ``flags`` has its port
    flag (``--http-port`` ...). ``executable``: the ``quiver`` to run (default :data:`QUIVER`).
    ``env``: added to this process's environment. The rest is :class:`Server`'s.
    """

    def __init__(
        self, repository: Path | str, flags: Sequence[str] = (), *, log: Path,
        listeners: Sequence[str] = ("HTTP", "GRPC", "Metrics"), executable: Path | str | None = None,
        env: Mapping[str, str] | None = None, timeout: float = READY_TIMEOUT, name: str = "quiver",
        **options: Any,
    ) -> None:
        ports = [arg for key in listeners if PORT_FLAGS[key] not in flags for arg in (PORT_FLAGS[key], "0")]
        argv = [str(executable or QUIVER), "serve", "--model-repository", str(repository), *ports, *flags]
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        super().__init__(name, argv, log=log, listeners=listeners, env=environment, timeout=timeout, **options)

    def start(self) -> Endpoints:
        require(self.argv[0], self.name)
        return super().start()


def require(executable: Path | str, name: str) -> None:
    """PeerError unless ``executable`` (a ``quiver``) can be run."""
    if not os.access(executable, os.X_OK):
        raise PeerError(
            f"{name}: {executable} not found: Quiver runs from the project's own venv; "
            "run `make setup` in the repository first"
        )


class QuiverPeer(Peer):
    def __init__(self, backend: str = "python", *, frontend_workers: int = 0, folder: Path | None = None) -> None:
        """``backend``: the ``tiny`` model's; ``frontend_workers``: ``--frontend-workers`` (0:
        the single-process server); ``folder``: where the server runs and writes ``server.log``
        (default: ``benchmarks/.work/peers/quiver/BACKEND`` or ``BACKEND-workersN``)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.backend = backend
        self.frontend_workers = frontend_workers
        workers = f", {frontend_workers} frontend workers" if frontend_workers > 1 else ""
        self.name = f"quiver ({backend} model{workers})"
        default = HOME / (f"{backend}-workers{frontend_workers}" if frontend_workers > 1 else backend)
        self.folder = folder if folder is not None else default
        self.server: QuiverServer | None = None

    @property
    def log(self) -> Path:
        return self.folder / "server.log"

    def setup(self) -> None:
        require(QUIVER, self.name)

    def write_repository(self) -> Path:
        repository = self.folder / "repository"
        shutil.rmtree(repository, ignore_errors=True)
        version = repository / tiny.MODEL / "1"
        version.mkdir(parents=True)
        if self.backend == "python":
            (repository / tiny.MODEL / "config.pbtxt").write_text(tiny.PYTHON_CONFIG)
            (version / "model.py").write_text(tiny.PYTHON_MODEL)
        else:
            (repository / tiny.MODEL / "config.pbtxt").write_text(ONNX_CONFIG)
            (version / "model.onnx").write_bytes(tiny.onnx_model())
        return repository

    def start(self, workload: str) -> Endpoints:
        if workload != tiny.MODEL:
            raise PeerError(f"{self.name}: workload {workload!r} not supported")
        if self.server is not None:
            raise PeerError(f"{self.name}: already started")
        self.setup()
        repository = self.write_repository()
        flags = ["--frontend-workers", str(self.frontend_workers)] if self.frontend_workers > 1 else []
        self.server = QuiverServer(
            repository, flags, log=self.log, cwd=self.folder, ready_path=f"/v2/models/{tiny.MODEL}/ready",
            name=self.name,
        )
        try:
            return self.server.start()
        except PeerError:
            self.server = None
            raise

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()


def _smoke(peer: Peer) -> None:
    """Start ``peer``, check one request in each encoding (the caller stops it)."""
    import numpy as np

    from benchmarks import loadgen

    x = (np.arange(16, dtype=np.float32).reshape(tiny.SHAPE) / 4 - 1)
    payload = loadgen.Payload(tiny.MODEL, {tiny.INPUT: x}, expected={tiny.OUTPUT: x * 2})
    peer.setup()
    began = time.monotonic()
    endpoints = peer.start(tiny.MODEL)
    print(f"[{peer.name}] ready in {time.monotonic() - began:.1f} s: {endpoints}")
    for encoding in loadgen.ENCODINGS:
        loadgen.sanity_check(*endpoints.address(encoding), encoding, payload)
        print(f"[{peer.name}] {encoding}: ok")


if __name__ == "__main__":
    sys.exit(smoke([QuiverPeer(backend) for backend in BACKENDS], _smoke))
