"""Quiver itself as a peer: ``quiver serve`` from the project's own virtual environment.

Quiver's "own environment" is the project venv (``.venv``, made by ``make setup``); nothing is
installed here, ``setup()`` only checks that ``.venv/bin/quiver`` exists.

Two variants serve the ``tiny`` workload:

* ``QuiverPeer("python")`` ("quiver (python model)"): the very ``config.pbtxt`` and ``model.py``
  the Triton peer serves (``backend: "python"``, ``TritonPythonModel`` using
  ``triton_python_backend_utils``): Quiver runs Triton Python models unchanged, so the two servers
  run the same model source;
* ``QuiverPeer("onnx")`` ("quiver (onnx model)"): the same function as an ONNX graph (one ``Mul``
  by a constant 2, built with ``onnx.helper``) on ``platform: "onnxruntime_onnx"``, same inputs,
  outputs, ``max_batch_size: 0`` and one CPU instance.

The server gets ``--http-port 0 --grpc-port 0 --metrics-port 0``; the ports it picked are read
from its log ("started HTTP service at H:P", "started GRPC service at H:P").

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

QUIVER = ROOT / ".venv" / "bin" / "quiver"
HOME = WORK / "quiver"
READY_TIMEOUT = 120.0
BACKENDS = ("python", "onnx")

_STARTED = re.compile(r"started (HTTP|GRPC) service at (\S+):(\d+)")

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
    def __init__(self, backend: str = "python") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.backend = backend
        self.name = f"quiver ({backend} model)"
        self.folder = HOME / backend
        self.proc: subprocess.Popen[bytes] | None = None

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
        log = self.folder / "server.log"
        argv = [
            str(QUIVER), "serve", "--model-repository", str(repository),
            "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            self.proc = spawn(argv, log=log, cwd=self.folder, env=env)
        except OSError as exc:
            raise PeerError(f"{self.name}: cannot run {QUIVER}: {exc}") from None
        try:
            found = self._listeners(log)
            wait_ready(self.proc, f"http://{found['HTTP']}/v2/models/{TINY_MODEL}/ready", log,
                       READY_TIMEOUT)
        except PeerError as exc:
            self.stop()
            raise PeerError(f"{self.name}: {exc}") from None
        return Endpoints(http=found["HTTP"], grpc=found["GRPC"], pid=self.proc.pid)

    def _listeners(self, log: Path) -> dict[str, str]:
        """{"HTTP": host:port, "GRPC": host:port} once the log has both lines."""
        assert self.proc is not None
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            found = {m.group(1): f"{m.group(2)}:{m.group(3)}" for m in _STARTED.finditer(text)}
            if len(found) == 2:
                return found
            if self.proc.poll() is not None:
                raise PeerError(f"exited with code {self.proc.returncode}: {tail(log)}")
            time.sleep(0.1)
        raise PeerError(f"no listener lines in its log after {READY_TIMEOUT:.0f} s: {tail(log)}")

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
