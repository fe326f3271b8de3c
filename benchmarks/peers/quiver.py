"""Quiver itself as a peer: ``quiver serve`` from the project's own virtual environment.

Quiver's "own environment" is the project venv (``.venv``, made by ``make setup``); nothing is
installed here, ``setup()`` only checks that ``quiver`` exists: the one next to the Python running
the benchmark (the project venv's, as the Makefile runs them), else ``.venv/bin/quiver``.

Two variants serve the ``tiny`` workload:

* ``QuiverPeer("python")`` ("quiver (python model)"): the very ``config.pbtxt`` and ``model.py``
  the Triton peer serves (``backend: "python"``, ``TritonPythonModel`` using
  ``triton_python_backend_utils``): Quiver runs Triton Python models unchanged, so the two servers
  run the same model source;
* ``QuiverPeer("onnx")`` ("quiver (onnx model)"): the same function as an ONNX graph (one ``Mul``
  by a constant 2, built with ``onnx.helper``) on ``platform: "onnxruntime_onnx"``, same inputs,
  outputs, ``max_batch_size: 0`` and one CPU instance.

The server gets ``--http-port 0 --grpc-port 0 --metrics-port 0``; the ports it picked are read
from its log ("started HTTP service at H:P", "started GRPC service at H:P", "started Metrics
service at H:P").

Other benchmarks serve their own repositories with their own flags the same way:
``QuiverPeer(folder=...).serve(repository, [flags...], ready_path=...)`` starts ``quiver serve``
on it and returns its :class:`Endpoints` (metrics address included); ``stop()`` stops it.

Run this file for a smoke check of both variants over HTTP JSON, HTTP binary and gRPC::

    .venv/bin/python benchmarks/peers/quiver.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks.peers`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers import (
    ROOT,
    TINY_INPUT,
    TINY_MODEL,
    TINY_OUTPUT,
    TINY_SHAPE,
    WORK,
    Endpoints,
    Peer,
    PeerError,
    spawn,
    tail,
    terminate,
    wait_ready,
)
from benchmarks.peers.triton import _CONFIG as PYTHON_CONFIG
from benchmarks.peers.triton import _MODEL_PY as PYTHON_MODEL

_BESIDE = Path(sys.executable).parent / "quiver"
QUIVER = _BESIDE if os.access(_BESIDE, os.X_OK) else ROOT / ".venv" / "bin" / "quiver"
HOME = WORK / "quiver"
READY_TIMEOUT = 120.0
BACKENDS = ("python", "onnx")

_STARTED = re.compile(r"started (HTTP|GRPC|Metrics) service at (\S+):(\d+)")
_LISTENERS = ("HTTP", "GRPC", "Metrics")

#: The Python model's configuration, served by ONNX Runtime (the event-loop opt-in is the
#: Python backend's: ONNX Runtime executions that are short always run there).
ONNX_CONFIG = "\n".join(
    'platform: "onnxruntime_onnx"' if line == 'backend: "python"' else line
    for line in PYTHON_CONFIG.splitlines()
    if "EXECUTE_ON_EVENT_LOOP" not in line and not line.startswith("# Quiver:")
) + "\n"


def tiny_onnx() -> bytes:
    """The ``tiny`` model as ONNX: ``OUTPUT0 = INPUT0 * 2``, FP32 [1, 16], opset 17."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", [TINY_INPUT, "two"], [TINY_OUTPUT])],
        TINY_MODEL,
        [helper.make_tensor_value_info(TINY_INPUT, TensorProto.FLOAT, list(TINY_SHAPE))],
        [helper.make_tensor_value_info(TINY_OUTPUT, TensorProto.FLOAT, list(TINY_SHAPE))],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


class QuiverPeer(Peer):
    def __init__(self, backend: str = "python", *, folder: Path | None = None) -> None:
        """``backend``: the ``tiny`` model's (``start``); ``folder``: where the server runs and
        writes ``server.log`` (default: ``benchmarks/.work/peers/quiver/BACKEND``)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.backend = backend
        self.name = f"quiver ({backend} model)"
        self.folder = folder if folder is not None else HOME / backend
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.folder / "server.log"

    def setup(self) -> None:
        if not os.access(QUIVER, os.X_OK):
            raise PeerError(
                f"{self.name}: {QUIVER} not found: Quiver runs from the project's own venv; "
                "run `make setup` in the repository first"
            )

    def write_repository(self) -> Path:
        repository = self.folder / "repository"
        shutil.rmtree(repository, ignore_errors=True)
        version = repository / TINY_MODEL / "1"
        version.mkdir(parents=True)
        if self.backend == "python":
            (repository / TINY_MODEL / "config.pbtxt").write_text(PYTHON_CONFIG)
            (version / "model.py").write_text(PYTHON_MODEL)
        else:
            (repository / TINY_MODEL / "config.pbtxt").write_text(ONNX_CONFIG)
            (version / "model.onnx").write_bytes(tiny_onnx())
        return repository

    def start(self, workload: str) -> Endpoints:
        if workload != TINY_MODEL:
            raise PeerError(f"{self.name}: workload {workload!r} not supported")
        if self.proc is not None:
            raise PeerError(f"{self.name}: already started")
        self.setup()
        repository = self.write_repository()
        return self.serve(repository, ready_path=f"/v2/models/{TINY_MODEL}/ready")

    def serve(
        self, repository: Path, flags: Sequence[str] = (), *, ready_path: str = "/v2/health/ready",
        timeout: float = READY_TIMEOUT,
    ) -> Endpoints:
        """``quiver serve --model-repository REPOSITORY`` with ephemeral HTTP, gRPC and metrics
        ports and ``flags``; returns once ``ready_path`` answers 200 (PeerError otherwise)."""
        if self.proc is not None:
            raise PeerError(f"{self.name}: already started")
        self.setup()
        self.folder.mkdir(parents=True, exist_ok=True)
        argv = [
            str(QUIVER), "serve", "--model-repository", str(repository),
            "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", *flags,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            self.proc = spawn(argv, log=self.log, cwd=self.folder, env=env)
        except OSError as exc:
            raise PeerError(f"{self.name}: cannot run {QUIVER}: {exc}") from None
        try:
            found = self._listeners(self.log, timeout)
            wait_ready(self.proc, f"http://{found['HTTP']}{ready_path}", self.log, timeout)
        except PeerError as exc:
            self.stop()
            raise PeerError(f"{self.name}: {exc}") from None
        return Endpoints(http=found["HTTP"], grpc=found["GRPC"], pid=self.proc.pid, metrics=found["Metrics"])

    def _listeners(self, log: Path, timeout: float = READY_TIMEOUT) -> dict[str, str]:
        """{"HTTP": host:port, "GRPC": host:port, "Metrics": host:port} once the log has all three."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            found = {m.group(1): f"{m.group(2)}:{m.group(3)}" for m in _STARTED.finditer(text)}
            if all(name in found for name in _LISTENERS):
                return found
            if self.proc.poll() is not None:
                raise PeerError(f"exited with code {self.proc.returncode}: {tail(log)}")
            time.sleep(0.1)
        raise PeerError(f"no listener lines in its log after {timeout:.0f} s: {tail(log)}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        terminate(proc)


def _smoke() -> int:
    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import loadgen

    x = (np.arange(16, dtype=np.float32).reshape(TINY_SHAPE) / 4 - 1)
    payload = loadgen.Payload(TINY_MODEL, {TINY_INPUT: x}, expected={TINY_OUTPUT: x * 2})
    failed = 0
    for backend in BACKENDS:
        peer = QuiverPeer(backend)
        try:
            peer.setup()
            began = time.monotonic()
            endpoints = peer.start(TINY_MODEL)
            print(f"[{peer.name}] ready in {time.monotonic() - began:.1f} s: {endpoints}")
            for encoding in loadgen.ENCODINGS:
                address = endpoints.grpc if encoding == "grpc" else endpoints.http
                assert address is not None
                host, port = address.rsplit(":", 1)
                loadgen.sanity_check(host, int(port), encoding, payload)
                print(f"[{peer.name}] {encoding}: ok")
        except (PeerError, RuntimeError) as exc:
            print(f"[{peer.name}] FAILED: {exc}")
            failed += 1
        finally:
            peer.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_smoke())
