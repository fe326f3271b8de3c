"""NVIDIA Triton Inference Server as a peer: the real ``tritonserver`` binary, CPU only.

The binary comes from the PyPI package ``nvidia-pytriton``, which bundles a ``tritonserver`` build
with only the Python backend (plus the shared libraries it needs, in ``nvidia_pytriton.libs``).
This peer uses the binary directly, not PyTriton's Python API: it writes an ordinary Triton model
repository and starts ``tritonserver`` on it, as one would run Triton from its container.

Three things make the bundled build run on a plain Debian machine outside PyTriton:

* ``LD_LIBRARY_PATH`` holds the package's ``.libs`` folder (``libtritonserver.so`` and friends)
  and the library directory of the interpreter in use; otherwise the Python backend's stub links
  whichever ``libpython3.X.so`` the system has, whose standard library may not match.
* The stub (``triton_python_backend_stub``) ships once per Python version, outside the backend
  folder; as PyTriton does, the one for the venv's Python is copied into a backend directory of
  our own, next to copies of ``libtriton_python.so`` and ``triton_python_backend_utils.py``.
* The stub runs Python in isolated mode (no ``PYTHONPATH``, no venv site-packages) with its working
  directory first on ``sys.path``, and it is built against the numpy 1.x ABI; so the server runs
  with a working directory holding ``numpy<2`` installed by ``pip install --target``.

Run this module for a smoke check: ``.venv/bin/python -m benchmarks.peers.triton`` (as a module,
from the repository root: run as a file, its folder would come first on ``sys.path`` and this
``triton.py`` would shadow the ``triton`` package).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks import peers
from benchmarks.peers import tiny

PYTRITON = "nvidia-pytriton==0.7.0"  # bundles tritonserver 2.51.0
STUB_NUMPY = "numpy==1.26.4"  # the last numpy 1.x: the stub is built against the 1.x ABI

HOME = peers.WORK / "triton"  # the virtual environment, and everything below it
REPOSITORY = HOME / "repository"
BACKENDS = HOME / "backends"  # our backend directory: python/ with the stub for our Python
STUB_SITE = HOME / "stub_site"  # the server's working directory: numpy<2 for the stub
SERVER_LOG = HOME / "server.log"
SETUP_LOG = peers.WORK / "triton-setup.log"  # outside HOME: ``venv --clear`` empties HOME

READY_TIMEOUT = 120.0

_PROBE = (
    "import json, sys, sysconfig; print(json.dumps({"
    "'libdir': sysconfig.get_config_var('LIBDIR'), "
    "'purelib': sysconfig.get_paths()['purelib'], "
    "'version': '%d.%d' % sys.version_info[:2]}))"
)


class TritonPeer(peers.Peer):
    name = "triton"

    def __init__(self) -> None:
        self._process: peers.Server | None = None
        self._server: Path | None = None  # the tritonserver binary
        self._libs: list[Path] = []  # for LD_LIBRARY_PATH, in order

    # -- install --------------------------------------------------------------------------

    def setup(self) -> None:
        python = peers.make_venv(HOME, [PYTRITON], SETUP_LOG)
        probe = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True)
        if probe.returncode != 0:
            raise peers.PeerError(f"triton: cannot run {python}: {probe.stderr.strip()[-300:]}")
        info = json.loads(probe.stdout)
        site = Path(info["purelib"])
        package = site / "pytriton"
        if not package.is_dir():
            raise peers.PeerError(f"triton: no pytriton package in {site}")

        server = _find_one(package, "tritonserver", executable=True)
        backend_lib = _find_one(package, "libtriton_python.so")
        stub = _find_stub(package, info["version"])
        if server is None:
            raise peers.PeerError(f"triton: no tritonserver binary found in {package}")
        utils = backend_lib and backend_lib.parent / "triton_python_backend_utils.py"
        if backend_lib is None or utils is None or not utils.is_file():
            raise peers.PeerError(f"triton: no Python backend (libtriton_python.so) found in {package}")
        if stub is None:
            raise peers.PeerError(
                f"triton: no triton_python_backend_stub for Python {info['version']} in {package}"
            )
        libs = sorted(site.glob("nvidia_pytriton*.libs")) + sorted(package.rglob("*.libs"))
        libs = [p for p in libs if p.is_dir()]
        if not libs:
            raise peers.PeerError(f"triton: no bundled .libs folder found for {package}")
        libdir = Path(info["libdir"] or "")
        if not libdir.is_dir() or not any(libdir.glob(f"libpython{info['version']}*.so*")):
            raise peers.PeerError(
                f"triton: no shared libpython{info['version']} in {libdir} (the Python backend "
                "stub needs the interpreter built with --enable-shared)"
            )

        # Our backend directory: python/ as the package has it, plus the stub for this Python.
        python_backend = BACKENDS / "python"
        python_backend.mkdir(parents=True, exist_ok=True)
        for source in (backend_lib, utils, stub):
            target = python_backend / source.name
            if not target.exists() or target.stat().st_size != source.stat().st_size:
                shutil.copy2(source, target)

        # The stub's numpy: a folder used as the server's working directory.
        marker = STUB_SITE / ".installed"
        if not (marker.exists() and marker.read_text() == STUB_NUMPY):
            shutil.rmtree(STUB_SITE, ignore_errors=True)
            with SETUP_LOG.open("ab") as out:
                argv = [str(python), "-m", "pip", "install", "--quiet", "--target",
                        str(STUB_SITE), STUB_NUMPY]
                if subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                    raise peers.PeerError(f"triton: pip install --target {STUB_SITE} failed: "
                                    f"{peers.tail(SETUP_LOG)}")
            marker.write_text(STUB_NUMPY)

        self._server = server
        self._libs = [*libs, libdir]

    # -- run ------------------------------------------------------------------------------

    def start(self, workload: str) -> peers.Endpoints:
        if workload != tiny.MODEL:
            raise peers.PeerError(f"triton: workload {workload} not supported")
        if self._process is not None:
            raise peers.PeerError("triton: already started")
        if self._server is None:
            self.setup()
        assert self._server is not None

        shutil.rmtree(REPOSITORY, ignore_errors=True)
        version = REPOSITORY / tiny.MODEL / "1"
        version.mkdir(parents=True)
        (REPOSITORY / tiny.MODEL / "config.pbtxt").write_text(tiny.PYTHON_CONFIG)
        (version / "model.py").write_text(tiny.PYTHON_MODEL)

        http, grpc, metrics = peers.distinct_ports(3)
        argv = [
            str(self._server),
            f"--model-repository={REPOSITORY}",
            f"--backend-directory={BACKENDS}",
            "--http-address=127.0.0.1", f"--http-port={http}",
            "--grpc-address=127.0.0.1", f"--grpc-port={grpc}",
            "--metrics-address=127.0.0.1", f"--metrics-port={metrics}",
            "--pinned-memory-pool-byte-size=0",  # no GPU: nothing to pin for
        ]
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(p) for p in self._libs] + [p for p in [env.get("LD_LIBRARY_PATH")] if p]
        )
        self._process = peers.Server(
            "triton", argv, log=SERVER_LOG, listeners=(), cwd=STUB_SITE, env=env, timeout=READY_TIMEOUT,
            addresses={"HTTP": f"127.0.0.1:{http}", "GRPC": f"127.0.0.1:{grpc}"},
            ready_path=f"/v2/models/{tiny.MODEL}/ready",
        )
        endpoints = self._process.start()
        try:
            _check_answer(http)
        except peers.PeerError as e:
            self.stop()
            raise peers.PeerError(f"triton: {e}") from None
        return endpoints

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.stop()


def _check_answer(port: int) -> None:
    """One JSON inference: a stub with the wrong numpy loads the model and reports it ready, then
    fails every request ("cannot reshape array of size 0"), so readiness alone proves too little."""
    x = [i / 4 - 1 for i in range(16)]
    body = {"inputs": [{"name": tiny.INPUT, "shape": list(tiny.SHAPE), "datatype": "FP32",
                        "data": x}]}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/{tiny.MODEL}/infer", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            y = json.loads(response.read())["outputs"][0]["data"]
    except urllib.error.HTTPError as e:
        raise peers.PeerError(f"first inference failed: {e.code} {e.read()[:300]!r}") from None
    except (OSError, ValueError, LookupError) as e:
        raise peers.PeerError(f"first inference failed: {e}") from None
    if y != [2 * v for v in x]:
        raise peers.PeerError(f"first inference answered {y}, not INPUT0 * 2")


def _find_one(root: Path, name: str, *, executable: bool = False) -> Path | None:
    """The first file called ``name`` below ``root`` (executable if asked), in a stable order."""
    for path in sorted(root.rglob(name)):
        if path.is_file() and (not executable or os.access(path, os.X_OK)):
            return path
    return None


def _find_stub(root: Path, version: str) -> Path | None:
    """The Python backend stub built for Python ``version`` ("3.11"): PyTriton keeps one per
    version in a folder named after it; a stub directly in the backend folder is taken as is."""
    stubs = sorted(p for p in root.rglob("triton_python_backend_stub") if p.is_file())
    for stub in stubs:
        if stub.parent.name == version:
            return stub
    for stub in stubs:
        if (stub.parent / "libtriton_python.so").is_file():
            return stub
    return None


def _smoke(peer: peers.Peer) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    began = time.monotonic()
    peer.setup()
    print(f"setup: {time.monotonic() - began:.1f} s")
    began = time.monotonic()
    endpoints = peer.start(tiny.MODEL)
    try:
        print(f"start: {time.monotonic() - began:.1f} s, {endpoints}")
        with urllib.request.urlopen(f"http://{endpoints.http}/v2", timeout=5) as response:
            meta = json.loads(response.read())
        print(f"server: {meta['name']} {meta['version']} extensions: {' '.join(meta['extensions'])}")

        x = np.arange(16, dtype=np.float32).reshape(tiny.SHAPE) / 4 - 1
        for binary in (True, False):
            client = httpclient.InferenceServerClient(endpoints.http)
            tensor = httpclient.InferInput(tiny.INPUT, list(tiny.SHAPE), "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            wanted = httpclient.InferRequestedOutput(tiny.OUTPUT, binary_data=binary)
            result = client.infer(tiny.MODEL, [tensor], outputs=[wanted])
            y = result.as_numpy(tiny.OUTPUT)
            assert y is not None and y.dtype == np.float32 and np.array_equal(y, x * 2), y
            client.close()
            print(f"http ({'binary' if binary else 'json'} tensors): ok")

        client = grpcclient.InferenceServerClient(endpoints.grpc)
        tensor = grpcclient.InferInput(tiny.INPUT, list(tiny.SHAPE), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(tiny.MODEL, [tensor])
        y = result.as_numpy(tiny.OUTPUT)
        assert y is not None and y.dtype == np.float32 and np.array_equal(y, x * 2), y
        client.close()
        print("grpc: ok")
    finally:
        peer.stop()
    print("stopped")


if __name__ == "__main__":
    sys.exit(peers.smoke([TritonPeer()], _smoke))
