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

Run this file to smoke-test both variants with ``tritonclient`` (HTTP JSON, HTTP with Triton's
binary tensor extension, gRPC)::

    .venv/bin/python benchmarks/peers/mlserver.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks.peers`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers import (
    TINY_INPUT,
    TINY_MODEL,
    TINY_OUTPUT,
    TINY_SHAPE,
    WORK,
    Endpoints,
    Peer,
    PeerError,
    free_port,
    make_venv,
    spawn,
    terminate,
    wait_ready,
)

HOME = WORK / "mlserver"
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
"""The ``tiny`` workload for MLServer: {TINY_OUTPUT} = {TINY_INPUT} * 2 (FP32 {list(TINY_SHAPE)})."""

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse


class {RUNTIME_CLASS}(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        for request_input in payload.inputs:
            if request_input.name == "{TINY_INPUT}":
                break
        else:
            raise MLServerError("missing input {TINY_INPUT}", status_code=400)
        x = NumpyCodec.decode_input(request_input)
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            id=payload.id,
            outputs=[NumpyCodec.encode_output("{TINY_OUTPUT}", x * 2)],
        )
'''


class MLServerPeer(Peer):
    def __init__(self, parallel_workers: int | None = None) -> None:
        self.parallel_workers = parallel_workers
        if parallel_workers is None:
            self.name = "mlserver"
            self.folder = HOME / "default"
        else:
            self.name = f"mlserver (parallel_workers {parallel_workers})"
            self.folder = HOME / f"parallel_workers_{parallel_workers}"
        self.proc: subprocess.Popen[bytes] | None = None

    def setup(self) -> None:
        make_venv(VENV, PACKAGES, HOME / "setup.log")

    def start(self, workload: str) -> Endpoints:
        if workload != TINY_MODEL:
            raise PeerError(f"{self.name}: unknown workload {workload!r}")
        mlserver = VENV / "bin" / "mlserver"
        if not mlserver.exists():
            raise PeerError(f"{self.name}: not set up ({mlserver} missing)")
        self.stop()
        http_port, grpc_port, metrics_port = _distinct_ports(3)
        self._write_repository(http_port, grpc_port, metrics_port)
        log = self.folder / "mlserver.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLSERVER_")}
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = spawn([str(mlserver), "start", str(self.folder)], log=log, cwd=self.folder, env=env)
        try:
            wait_ready(self.proc, f"http://127.0.0.1:{http_port}/v2/models/{TINY_MODEL}/ready", log, READY_TIMEOUT)
        except PeerError as exc:
            self.stop()
            raise PeerError(f"{self.name}: {exc}") from None
        return Endpoints(http=f"127.0.0.1:{http_port}", grpc=f"127.0.0.1:{grpc_port}", pid=self.proc.pid)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        terminate(proc)
        # The parallel workers are in the server's process group: make sure none outlived it.
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            time.sleep(0.1)

    def _write_repository(self, http_port: int, grpc_port: int, metrics_port: int) -> None:
        model = self.folder / TINY_MODEL
        model.mkdir(parents=True, exist_ok=True)
        (model / f"{RUNTIME_MODULE}.py").write_text(RUNTIME_SOURCE)
        tensor = {"datatype": "FP32", "shape": list(TINY_SHAPE)}
        model_settings = {
            "name": TINY_MODEL,
            "implementation": f"{RUNTIME_MODULE}.{RUNTIME_CLASS}",
            "inputs": [{"name": TINY_INPUT, **tensor}],
            "outputs": [{"name": TINY_OUTPUT, **tensor}],
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


def _distinct_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


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

    if datatype != "FP32" or list(shape) != list(TINY_SHAPE):
        raise AssertionError(f"{where}: answered {datatype} {list(shape)}, expected FP32 {list(TINY_SHAPE)}")
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
    endpoints = peer.start(TINY_MODEL)
    print(f"[{peer.name}] ready in {time.monotonic() - started:.1f} s: {endpoints}")
    try:
        children = _children(endpoints.pid)
        print(f"[{peer.name}] {len(children)} child process(es) of {endpoints.pid}:")
        for line in children:
            print(f"    {line}")
        x = np.arange(16, dtype=np.float32).reshape(TINY_SHAPE) / 4 - 1
        expected = x * 2

        http = httpclient.InferenceServerClient(endpoints.http)
        try:
            metadata = http.get_model_metadata(TINY_MODEL)
            print(f"[{peer.name}] metadata: {metadata}")

            inp = httpclient.InferInput(TINY_INPUT, list(TINY_SHAPE), "FP32")
            inp.set_data_from_numpy(x, binary_data=False)
            out = httpclient.InferRequestedOutput(TINY_OUTPUT, binary_data=False)
            result = http.infer(TINY_MODEL, [inp], outputs=[out])
            output = result.get_output(TINY_OUTPUT)
            _check("HTTP JSON", result.as_numpy(TINY_OUTPUT), output["datatype"], output["shape"], expected)
            print(f"[{peer.name}] HTTP JSON: ok ({output['datatype']} {output['shape']})")

            inp = httpclient.InferInput(TINY_INPUT, list(TINY_SHAPE), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            out = httpclient.InferRequestedOutput(TINY_OUTPUT, binary_data=True)
            try:
                result = http.infer(TINY_MODEL, [inp], outputs=[out])
                output = result.get_output(TINY_OUTPUT)
                _check("HTTP binary", result.as_numpy(TINY_OUTPUT), output["datatype"], output["shape"], expected)
                print(f"[{peer.name}] HTTP binary tensor extension: ok ({output})")
            except Exception as exc:  # reported, not fatal: MLServer may lack it
                print(f"[{peer.name}] HTTP binary tensor extension: NOT supported: {type(exc).__name__}: {exc}")

            inp = httpclient.InferInput(TINY_INPUT, list(TINY_SHAPE), "FP32")
            inp.set_data_from_numpy(x, binary_data=False)
            out = httpclient.InferRequestedOutput(TINY_OUTPUT, binary_data=True)
            try:
                result = http.infer(TINY_MODEL, [inp], outputs=[out])
                output = result.get_output(TINY_OUTPUT)
                _check("HTTP binary output", result.as_numpy(TINY_OUTPUT), output["datatype"], output["shape"], expected)
                print(f"[{peer.name}] HTTP JSON input, binary output requested: answered {output}")
            except Exception as exc:  # reported, not fatal
                print(f"[{peer.name}] HTTP JSON input, binary output requested: {type(exc).__name__}: {exc}")
        finally:
            http.close()

        grpc = grpcclient.InferenceServerClient(endpoints.grpc)
        try:
            inp = grpcclient.InferInput(TINY_INPUT, list(TINY_SHAPE), "FP32")
            inp.set_data_from_numpy(x)  # raw_input_contents
            out = grpcclient.InferRequestedOutput(TINY_OUTPUT)
            result = grpc.infer(TINY_MODEL, [inp], outputs=[out])
            response = result.get_response()
            output = result.get_output(TINY_OUTPUT)
            _check("gRPC", result.as_numpy(TINY_OUTPUT), output.datatype, list(output.shape), expected)
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


def main() -> int:
    failed = 0
    for peer in (MLServerPeer(), MLServerPeer(parallel_workers=0)):
        try:
            _smoke(peer)
        except (PeerError, AssertionError) as exc:
            print(f"[{peer.name}] FAILED: {exc}")
            failed += 1
        finally:
            peer.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
