"""Seldon MLServer as a peer: the ``tiny`` workload as a custom Python runtime.

MLServer serves models through "runtimes", ``MLModel`` subclasses. There is no built-in runtime
for "multiply by two", so the model folder holds a small one of ours, written as an MLServer user
would write it for speed: decode the input with the NumPy codec, compute, encode the output with
the same codec, no per-request logging. ``settings.json`` turns debug mode (and with it uvicorn's
access log) off.

Two variants share one virtual environment:

* ``MLServerPeer()``: MLServer's defaults, i.e. ``parallel_workers`` 1 -- inference runs in one
  worker process the main process forwards every request to;
* ``MLServerPeer(parallel_workers=0)``: inference runs in the main process itself.

Run this module to smoke-test both variants with ``tritonclient`` (HTTP JSON, HTTP with Triton's
binary tensor extension, gRPC)::

    .venv/bin/python -m benchmarks.peers.mlserver
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from benchmarks import peers
from benchmarks.peers import tiny

HOME = peers.WORK / "mlserver"
VENV = HOME / "venv"  # not HOME itself: ``venv --clear`` would wipe the logs and model folders
PACKAGES = [
    "mlserver==1.7.1",
    # uvloop 0.22 breaks MLServer's parallel workers (they never come up)
    "uvloop<0.22",
]
READY_TIMEOUT = 120.0

RUNTIME_MODULE = "tiny_runtime"
RUNTIME_CLASS = "TinyRuntime"
RUNTIME_SOURCE = f'''\
"""The ``tiny`` workload for MLServer: {tiny.OUTPUT} = {tiny.INPUT} * 2 (FP32 {list(tiny.SHAPE)})."""

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse


class {RUNTIME_CLASS}(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        for request_input in payload.inputs:
            if request_input.name == "{tiny.INPUT}":
                break
        else:
            raise MLServerError("missing input {tiny.INPUT}", status_code=400)
        x = NumpyCodec.decode_input(request_input)
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            id=payload.id,
            outputs=[NumpyCodec.encode_output("{tiny.OUTPUT}", x * 2)],
        )
'''


class MLServerPeer(peers.Peer):
    def __init__(self, parallel_workers: int | None = None) -> None:
        self.parallel_workers = parallel_workers
        if parallel_workers is None:
            self.name = "mlserver"
            self.folder = HOME / "default"
        else:
            self.name = f"mlserver (parallel_workers {parallel_workers})"
            self.folder = HOME / f"parallel_workers_{parallel_workers}"
        self.server: peers.Server | None = None

    def setup(self) -> None:
        peers.make_venv(VENV, PACKAGES, HOME / "setup.log")

    def start(self, workload: str) -> peers.Endpoints:
        if workload != tiny.MODEL:
            raise peers.PeerError(f"{self.name}: unknown workload {workload!r}")
        mlserver = VENV / "bin" / "mlserver"
        if not mlserver.exists():
            raise peers.PeerError(f"{self.name}: not set up ({mlserver} missing)")
        self.stop()
        http_port, grpc_port, metrics_port = peers.distinct_ports(3)
        self._write_repository(http_port, grpc_port, metrics_port)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLSERVER_")}
        env["PYTHONUNBUFFERED"] = "1"
        self.server = peers.Server(
            self.name, [mlserver, "start", self.folder], log=self.folder / "mlserver.log", listeners=(),
            addresses={"HTTP": f"127.0.0.1:{http_port}", "GRPC": f"127.0.0.1:{grpc_port}"},
            ready_path=f"/v2/models/{tiny.MODEL}/ready", timeout=READY_TIMEOUT, cwd=self.folder, env=env,
        )
        return self.server.start()

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()  # the parallel workers are in the server's process group: none outlives it

    def _write_repository(self, http_port: int, grpc_port: int, metrics_port: int) -> None:
        model = self.folder / tiny.MODEL
        model.mkdir(parents=True, exist_ok=True)
        (model / f"{RUNTIME_MODULE}.py").write_text(RUNTIME_SOURCE)
        tensor = {"datatype": "FP32", "shape": list(tiny.SHAPE)}
        model_settings = {
            "name": tiny.MODEL,
            "implementation": f"{RUNTIME_MODULE}.{RUNTIME_CLASS}",
            "inputs": [{"name": tiny.INPUT, **tensor}],
            "outputs": [{"name": tiny.OUTPUT, **tensor}],
        }
        (model / "model-settings.json").write_text(json.dumps(model_settings, indent=2) + "\n")
        settings: dict[str, object] = {
            "debug": False,  # also turns uvicorn's access log (one line per request) off
            "host": "127.0.0.1",
            "http_port": http_port,
            "grpc_port": grpc_port,
            "metrics_port": metrics_port,
            "metrics_dir": str(self.folder / ".metrics"),
            "environments_dir": str(self.folder / ".envs"),
            "load_models_at_startup": True,
        }
        if self.parallel_workers is not None:
            settings["parallel_workers"] = self.parallel_workers
        (self.folder / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")


# -- smoke check --------------------------------------------------------------------------


def _children(pid: int) -> list[str]:
    """Every descendant of ``pid``, as "pid command" lines."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    parent_of: dict[int, int] = {}
    command: dict[int, str] = {}
    for line in out.splitlines():
        fields = line.split(None, 2)
        if len(fields) >= 2:
            parent_of[int(fields[0])] = int(fields[1])
            command[int(fields[0])] = fields[2] if len(fields) > 2 else ""
    found, frontier = [], {pid}
    while frontier:
        kids = {child for child, parent in parent_of.items() if parent in frontier}
        found.extend(sorted(kids))
        frontier = kids
    return [f"{child} {command[child][:100]}" for child in found]


def _group(pgid: int) -> list[str]:
    """Every process still in process group ``pgid`` (the server's session), as "pid command"."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,pgid=,args="], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if len(line.split()) >= 2 and line.split()[1] == str(pgid)]


def _check(where: str, array: object, datatype: str, shape: list[int], expected: object) -> None:
    import numpy as np

    if datatype != "FP32" or list(shape) != list(tiny.SHAPE):
        raise AssertionError(f"{where}: answered {datatype} {list(shape)}, expected FP32 {list(tiny.SHAPE)}")
    if not isinstance(array, np.ndarray) or array.dtype != np.float32 or not np.array_equal(array, expected):
        raise AssertionError(f"{where}: answered {array!r}, expected {expected!r}")


def _smoke(peer: MLServerPeer) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    started = time.monotonic()
    peer.setup()
    print(f"[{peer.name}] setup {time.monotonic() - started:.1f} s")
    started = time.monotonic()
    endpoints = peer.start(tiny.MODEL)
    print(f"[{peer.name}] ready in {time.monotonic() - started:.1f} s: {endpoints}")
    try:
        children = _children(endpoints.pid)
        print(f"[{peer.name}] {len(children)} child process(es) of {endpoints.pid}:")
        for line in children:
            print(f"    {line}")
        x = np.arange(16, dtype=np.float32).reshape(tiny.SHAPE) / 4 - 1
        expected = x * 2

        http = httpclient.InferenceServerClient(endpoints.http)
        try:
            metadata = http.get_model_metadata(tiny.MODEL)
            print(f"[{peer.name}] metadata: {metadata}")

            def infer(where: str, binary_input: bool, binary_output: bool) -> Any:
                inp = httpclient.InferInput(tiny.INPUT, list(tiny.SHAPE), "FP32")
                inp.set_data_from_numpy(x, binary_data=binary_input)
                out = httpclient.InferRequestedOutput(tiny.OUTPUT, binary_data=binary_output)
                result = http.infer(tiny.MODEL, [inp], outputs=[out])
                output = result.get_output(tiny.OUTPUT)
                _check(where, result.as_numpy(tiny.OUTPUT), output["datatype"], output["shape"], expected)
                return output

            output = infer("HTTP JSON", False, False)
            print(f"[{peer.name}] HTTP JSON: ok ({output['datatype']} {output['shape']})")
            try:
                output = infer("HTTP binary", True, True)
                print(f"[{peer.name}] HTTP binary tensor extension: ok ({output})")
            except Exception as exc:  # reported, not fatal: MLServer may lack it
                print(f"[{peer.name}] HTTP binary tensor extension: NOT supported: {type(exc).__name__}: {exc}")
            try:
                output = infer("HTTP binary output", False, True)
                print(f"[{peer.name}] HTTP JSON input, binary output requested: answered {output}")
            except Exception as exc:  # reported, not fatal
                print(f"[{peer.name}] HTTP JSON input, binary output requested: {type(exc).__name__}: {exc}")
        finally:
            http.close()

        grpc = grpcclient.InferenceServerClient(endpoints.grpc)
        try:
            inp = grpcclient.InferInput(tiny.INPUT, list(tiny.SHAPE), "FP32")
            inp.set_data_from_numpy(x)  # raw_input_contents
            out = grpcclient.InferRequestedOutput(tiny.OUTPUT)
            result = grpc.infer(tiny.MODEL, [inp], outputs=[out])
            response = result.get_response()
            output = result.get_output(tiny.OUTPUT)
            _check("gRPC", result.as_numpy(tiny.OUTPUT), output.datatype, list(output.shape), expected)
            encoding = "raw_output_contents" if response.raw_output_contents else "typed contents"
            print(f"[{peer.name}] gRPC (raw_input_contents): ok ({output.datatype} {list(output.shape)}, answered in {encoding})")
        finally:
            grpc.close()
    finally:
        pid = endpoints.pid
        peer.stop()
        peer.stop()  # safe twice
        left = _group(pid)
        if left:
            raise AssertionError(f"{peer.name}: processes left after stop: {left}")
        print(f"[{peer.name}] stopped, no process left")


if __name__ == "__main__":
    sys.exit(peers.smoke((MLServerPeer(), MLServerPeer(parallel_workers=0)), _smoke))
