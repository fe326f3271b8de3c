"""Start a real ``quiver serve`` process on an ephemeral port for a test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

_STARTED = re.compile(r"started (HTTP|GRPC) service at ([\d.]+|\[[0-9a-f:]+\]|[0-9a-f:]+):(\d+)")
_METRICS = re.compile(r"started Metrics service at ([\d.]+|\[[0-9a-f:]+\]|[0-9a-f:]+):(\d+)")
_SAGEMAKER = re.compile(r"started SageMaker service at ([\d.]+|\[[0-9a-f:]+\]|[0-9a-f:]+):(\d+)")


class QuiverServer:
    """``with QuiverServer(repo) as server: server.url``; logs are kept in ``server.log``.

    Every listener gets a free port (``--http-port 0 --grpc-port 0 --metrics-port 0``);
    ``server.url`` is the HTTP one, ``server.grpc_url`` the gRPC one, for
    ``tritonclient.http``/``.grpc``, ``server.metrics_url`` the Prometheus one.

    ``sagemaker=True``, or SageMaker variables in ``env``, also opens the SageMaker listener
    on a free port (``--sagemaker-port 0``): ``server.sagemaker_url``. ``env`` adds variables
    to the server's environment; ``SAGEMAKER_*`` variables of the test process are not
    passed on, so only a test's own ``env`` turns SageMaker modes on.
    """

    def __init__(
        self,
        *repositories: Path,
        args: tuple[str, ...] = (),
        timeout: float = 60.0,
        sagemaker: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.repositories = repositories
        self.args = args
        self.timeout = timeout
        self.env = dict(env or {})
        self.sagemaker = sagemaker or any(
            k == "SAGEMAKER_MULTI_MODEL" or k.startswith("SAGEMAKER_TRITON_") for k in self.env
        )
        self.sagemaker_port = 0
        self.lines: list[str] = []
        self.process: subprocess.Popen[str] | None = None
        self.port = 0
        self.grpc_port = 0
        self.metrics_port = 0  # 0 until the log says which (it logs before HTTP and gRPC do)
        self._started = threading.Event()
        self._reader: threading.Thread | None = None

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_for_log(self, text: str, timeout: float = 15.0) -> bool:
        """Whether ``text`` shows up in the server's output within ``timeout`` seconds (its
        lines are read by a thread, so a line logged just before an answer may come after it)."""
        deadline = time.monotonic() + timeout
        while text not in self.log:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """``http://127.0.0.1:PORT/metrics`` (the server gets ``--metrics-port 0``)."""
        if not self.metrics_port:
            raise RuntimeError(f"the server logged no metrics listener:\n{self.log}")
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def sagemaker_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the SageMaker listener (``sagemaker=True``)."""
        if not self.sagemaker_port:
            raise RuntimeError(f"the server logged no SageMaker listener:\n{self.log}")
        return f"http://127.0.0.1:{self.sagemaker_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "quiver", "serve", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
        for repository in self.repositories:
            cmd += ["--model-repository", str(repository)]
        if self.sagemaker and not any(a.startswith("--sagemaker-port") for a in self.args):
            cmd += ["--sagemaker-port", "0"]
        if self.sagemaker and not any(a.startswith("--allow-sagemaker") for a in self.args):
            cmd += ["--allow-sagemaker"]
        if not any(a.startswith(("--frontend-workers", "--http-workers")) for a in self.args):
            cmd += ["--frontend-workers", "0"]  # the same server on any machine (auto depends on its cores)
        return cmd + list(self.args)

    def start(self) -> QuiverServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SAGEMAKER_")}
        env.update(self.env, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.timeout
        while not self._started.wait(0.05):
            if self.process.poll() is not None:
                self._close()
                raise RuntimeError(
                    f"quiver exited with {self.process.returncode} before listening:\n{self.log}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"quiver did not start within {self.timeout} s:\n{self.log}")
        return self

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            metrics = _METRICS.search(line)
            if metrics:
                self.metrics_port = int(metrics.group(2))
            sagemaker = _SAGEMAKER.search(line)
            if sagemaker:
                self.sagemaker_port = int(sagemaker.group(2))
                # SageMaker alone (as Triton's SageMaker container runs): its line is the last.
                if self._disabled("--allow-http") and self._disabled("--allow-grpc"):
                    self._started.set()
            match = _STARTED.search(line)
            if match and not self._started.is_set():
                if match.group(1) == "GRPC":
                    self.grpc_port = int(match.group(3))
                    # HTTP's line comes last when it is on; wait for it unless it is off.
                    if not self._http_disabled():
                        continue
                else:
                    self.port = int(match.group(3))
                self._started.set()

    def _http_disabled(self) -> bool:
        return self._disabled("--allow-http")

    def _disabled(self, flag: str) -> bool:
        """``FLAG=false`` (or ``FLAG false``) among the args; the last one wins."""
        args = list(self.args)
        disabled = False
        for index, arg in enumerate(args):
            if arg.startswith(flag + "="):
                disabled = arg.split("=", 1)[1].lower() in ("false", "0", "no", "off")
            elif arg == flag:
                value = args[index + 1] if index + 1 < len(args) else "true"
                disabled = value.lower() in ("false", "0", "no", "off")
        return disabled

    def wait(self, timeout: float = 30.0) -> int:
        """Wait for the process to exit by itself; returns its exit code."""
        assert self.process is not None
        code = self.process.wait(timeout)
        self._close()
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
                raise RuntimeError(f"quiver did not stop within {timeout} s:\n{self.log}") from None
        self._close()
        return self.process.returncode

    def _close(self) -> None:
        assert self.process is not None
        if self._reader is not None:
            self._reader.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def __enter__(self) -> QuiverServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def run_quiver(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m quiver ARGS`` to completion (for start-up failures and --help).

    ``serve`` gets port 0 for each listener the arguments leave unset, so a test never
    collides with a server on the default ports.
    """
    extra: list[str] = []
    if args and args[0] == "serve":
        for flag in ("--http-port", "--grpc-port", "--metrics-port"):
            if not any(a == flag or a.startswith(flag + "=") for a in args):
                extra += [flag, "0"]
    return subprocess.run(
        [sys.executable, "-m", "quiver", *args, *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
