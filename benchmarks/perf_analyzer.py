"""Triton's own C++ load generator, ``perf_analyzer``, as a second and independent client.

``setup()`` installs it under ``benchmarks/.work/perf_analyzer/`` and changes nothing outside:

* ``venv/``: a virtual environment holding the PyPI wheel ``perf-analyzer`` (pinned by version
  and hash). The wheel is tagged ``manylinux_2_38`` and this machine's glibc is 2.36, so pip
  would refuse it for this platform; it is installed with ``--platform`` into the venv's
  ``site-packages``. It holds one executable, ``perf_analyzer/bin/perf_analyzer``, and no
  libraries of its own (any it ships in a later version are put on the library path).
* ``root/``: Debian 13 ("trixie") ``libc6``, ``libstdc++6`` and ``libgcc-s1``, fetched with
  ``apt-get download`` through a private sources list and private apt state and cache
  (``apt/``), from the Debian mirror the system's own sources use, and unpacked with
  ``dpkg-deb -x``. The executable needs glibc 2.38 and a newer libstdc++ than Debian 12's.
* The executable is started through that folder's dynamic loader::

      root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 \\
          --library-path root/usr/lib/x86_64-linux-gnu venv/.../perf_analyzer/bin/perf_analyzer ...

  so libc, libm, libstdc++ and libgcc_s come from trixie, and the rest it needs (libz,
  libssl, libcrypto: stable ABIs) from the system, as the loader resolves them by default.
  Setup checks that resolution with the loader's ``--list``.

``run(url=..., protocol=..., model=..., concurrency=...)`` measures one concurrency level and
returns throughput, latency percentiles and the CPU time perf_analyzer itself used. A failed
step raises :class:`PerfAnalyzerError` whose message says what failed.

perf_analyzer reads the server's model metadata, model configuration and statistics before it
sends load, and stops at the first failed request, so a run also checks those extensions.

Run this module to set up and smoke-test it against Quiver (the ``tiny`` workload's ONNX model,
HTTP and gRPC, concurrency 1 and 8), from the repository root::

    .venv/bin/python -m benchmarks.perf_analyzer
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers import PeerError

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / ".work" / "perf_analyzer"
VENV = WORK / "venv"
APT = WORK / "apt"
DEBS = WORK / "debs"
SYSROOT = WORK / "root"
LOG = WORK / "setup.log"
READY = WORK / "ready.json"

WHEEL = "perf-analyzer"
WHEEL_VERSION = "2.60.0"
WHEEL_PLATFORM = "manylinux_2_38_x86_64"
WHEEL_SHA256 = "23ef56b107ae9233e5cf09fbdf508dd9b936a52f1bae2f63f53c8117087b3f25"

DEBIAN_SUITE = "trixie"
DEBIAN_PACKAGES = ("libc6", "libstdc++6", "libgcc-s1")
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
MULTIARCH = "x86_64-linux-gnu"
LOADER_NAME = "ld-linux-x86-64.so.2"
# What must come from the private folder rather than the system.
PRIVATE_LIBS = ("libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1")


class PerfAnalyzerError(PeerError):
    """perf_analyzer could not be installed, or a measurement failed; the message says why."""


@dataclass(frozen=True)
class Installation:
    """How to start perf_analyzer: through the private loader, with the private libraries."""

    loader: Path
    library_path: tuple[Path, ...]
    executable: Path
    versions: dict[str, str]
    resolved: dict[str, str]  # needed library -> the file the loader picks

    def argv(self, args: list[str]) -> list[str]:
        return [
            str(self.loader),
            "--library-path",
            ":".join(str(p) for p in self.library_path),
            str(self.executable),
            *args,
        ]


# -- setup --------------------------------------------------------------------------------


def _tail(text: str, lines: int = 8) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) or "(no output)"


def _step(
    what: str, argv: list[str], *, cwd: Path | None = None, timeout: float = 600, stderr: bool = False
) -> str:
    """Run one setup command, appending its output to the setup log; raise on failure.
    Returns its standard output (followed by its standard error with ``stderr=True``)."""
    LOG.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PerfAnalyzerError(f"{what} failed: {exc}") from exc
    with LOG.open("a") as log:
        log.write(f"$ {' '.join(argv)}\n{done.stdout}{done.stderr}[exit {done.returncode}]\n")
    if done.returncode != 0:
        raise PerfAnalyzerError(f"{what} failed (exit {done.returncode}): {_tail(done.stderr or done.stdout)}")
    return done.stdout + done.stderr if stderr else done.stdout


def _site_packages() -> Path:
    return VENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _install_wheel() -> Path:
    """The venv with the wheel in it; returns the real perf_analyzer executable."""
    requirement = f"{WHEEL}=={WHEEL_VERSION} --hash=sha256:{WHEEL_SHA256}"
    marker = VENV / ".installed"
    executable = _site_packages() / "perf_analyzer" / "bin" / "perf_analyzer"
    if marker.exists() and marker.read_text() == requirement and executable.exists():
        return executable
    _step("creating the perf_analyzer venv", [sys.executable, "-m", "venv", "--clear", str(VENV)])
    requirements = WORK / "requirements.txt"
    requirements.write_text(requirement + "\n")
    _step(
        f"pip install {WHEEL}=={WHEEL_VERSION}",
        [
            str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
            "--only-binary=:all:", "--platform", WHEEL_PLATFORM, "--require-hashes",
            "--target", str(_site_packages()), "--upgrade", "-r", str(requirements),
        ],
    )
    if not executable.exists():
        found = sorted(str(p.relative_to(VENV)) for p in VENV.rglob("perf_analyzer") if p.is_file())
        raise PerfAnalyzerError(f"the {WHEEL} wheel has no perf_analyzer/bin/perf_analyzer (found: {found})")
    executable.chmod(0o755)
    marker.write_text(requirement)
    return executable


def _system_mirror() -> str:
    """The Debian archive URI the system's apt sources use (not the security archive)."""
    texts: list[str] = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if path.suffix in (".list", ".sources") and path.is_file():
            with contextlib.suppress(OSError):
                texts.append(path.read_text())
    uris: list[str] = []
    for text in texts:
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("URIs:"):
                uris += line.split()[1:]
            elif line.startswith("deb "):
                words = [w for w in re.sub(r"\[[^]]*\]", " ", line).split() if w]
                if len(words) > 1:
                    uris.append(words[1])
    for uri in uris:
        if uri.rstrip("/").endswith("/debian"):
            return uri.rstrip("/")
    return DEFAULT_MIRROR


def _apt_options() -> list[str]:
    """apt reads our sources list and keeps its lists and downloads in ``apt/``, not the system's."""
    return [
        "-o", f"Dir::Etc::SourceList={APT / 'sources.list'}",
        "-o", "Dir::Etc::SourceParts=/dev/null",
        "-o", "Dir::Etc::Preferences=/dev/null",
        "-o", "Dir::Etc::PreferencesParts=/dev/null",
        "-o", f"Dir::State={APT / 'state'}",
        "-o", f"Dir::State::status={APT / 'status'}",
        "-o", f"Dir::Cache={APT / 'cache'}",
        # The private folders belong to root; apt's download sandbox user could not write them.
        "-o", "APT::Sandbox::User=root",
        "-q",
    ]


def _install_debian_libraries() -> dict[str, str]:
    """Debian 13's libc6, libstdc++6 and libgcc-s1 unpacked into ``root/``; returns versions."""
    marker = SYSROOT / ".installed"
    wanted = " ".join(DEBIAN_PACKAGES)
    if marker.exists():
        with contextlib.suppress(ValueError, KeyError):
            recorded = json.loads(marker.read_text())
            if recorded["packages"] == wanted and (SYSROOT / "usr" / "lib" / MULTIARCH / LOADER_NAME).exists():
                return dict(recorded["versions"])
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise PerfAnalyzerError(f"{tool} is not installed (needed to fetch Debian {DEBIAN_SUITE} libraries)")
    if not DEBIAN_KEYRING.exists():
        raise PerfAnalyzerError(f"{DEBIAN_KEYRING} is missing (package debian-archive-keyring)")
    mirror = _system_mirror()
    for folder in (APT / "state" / "lists" / "partial", APT / "cache" / "archives" / "partial"):
        folder.mkdir(parents=True, exist_ok=True)
    (APT / "status").touch()
    (APT / "sources.list").write_text(
        f"deb [signed-by={DEBIAN_KEYRING}] {mirror} {DEBIAN_SUITE} main\n"
    )
    _step(f"apt-get update for Debian {DEBIAN_SUITE} ({mirror}, private lists)",
          ["apt-get", *_apt_options(), "update"], timeout=600)
    shutil.rmtree(DEBS, ignore_errors=True)
    DEBS.mkdir(parents=True)
    _step(f"apt-get download {wanted} ({DEBIAN_SUITE})",
          ["apt-get", *_apt_options(), "download", *DEBIAN_PACKAGES], cwd=DEBS, timeout=600)
    shutil.rmtree(SYSROOT, ignore_errors=True)
    SYSROOT.mkdir(parents=True)
    versions: dict[str, str] = {}
    for deb in sorted(DEBS.glob("*.deb")):
        fields = _step(f"dpkg-deb -f {deb.name}", ["dpkg-deb", "-f", str(deb), "Package", "Version"])
        info = dict(line.split(": ", 1) for line in fields.strip().splitlines() if ": " in line)
        versions[info.get("Package", deb.name)] = info.get("Version", "?")
        _step(f"dpkg-deb -x {deb.name}", ["dpkg-deb", "-x", str(deb), str(SYSROOT)])
    missing = [name for name in DEBIAN_PACKAGES if name not in versions]
    if missing:
        raise PerfAnalyzerError(f"apt-get download did not fetch {missing} from Debian {DEBIAN_SUITE}")
    if not (SYSROOT / "usr" / "lib" / MULTIARCH / LOADER_NAME).exists():
        raise PerfAnalyzerError(f"no {LOADER_NAME} in the unpacked {DEBIAN_SUITE} libc6")
    marker.write_text(json.dumps({"packages": wanted, "versions": versions}))
    return versions


def _wheel_library_dirs(executable: Path) -> list[Path]:
    """Folders of shared libraries the wheel ships beside its executable (none in 2.60.0)."""
    package = executable.parents[1]
    candidates = [package, *package.parent.glob(f"{package.name}*.libs")]
    dirs = {
        lib.parent
        for top in candidates
        for lib in top.rglob("*.so*")
        if lib.is_file() and ".so" in lib.name
    }
    return sorted(dirs)


def _resolve(loader: Path, library_path: tuple[Path, ...], executable: Path) -> dict[str, str]:
    """What the private loader loads for each needed library (``ld.so --list``); raise if any
    is missing or if libc and the C++ runtime would come from the system."""
    listing = _step(
        "listing perf_analyzer's libraries through the private loader",
        [str(loader), "--library-path", ":".join(map(str, library_path)), "--list", str(executable)],
        timeout=60,
    )
    resolved: dict[str, str] = {}
    for line in listing.splitlines():
        match = re.match(r"\s*(\S+) => (.+?)(?: \(0x[0-9a-f]+\))?$", line)
        if match:
            resolved[match.group(1)] = match.group(2)
    missing = [name for name, where in resolved.items() if "not found" in where]
    if missing:
        raise PerfAnalyzerError(f"perf_analyzer's libraries not found through the private loader: {missing}")
    private = str(SYSROOT)
    wrong = [name for name in PRIVATE_LIBS if not resolved.get(name, "").startswith(private)]
    if wrong:
        raise PerfAnalyzerError(f"{wrong} do not resolve inside {SYSROOT}: {resolved}")
    return resolved


def setup() -> Installation:
    """Install perf_analyzer and its private libraries (idempotent; quick once done)."""
    WORK.mkdir(parents=True, exist_ok=True)
    loader = SYSROOT / "usr" / "lib" / MULTIARCH / LOADER_NAME
    if READY.exists():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            ready = json.loads(READY.read_text())
            install = Installation(
                loader=Path(ready["loader"]),
                library_path=tuple(Path(p) for p in ready["library_path"]),
                executable=Path(ready["executable"]),
                versions=dict(ready["versions"]),
                resolved=dict(ready["resolved"]),
            )
            if (
                ready["wheel"] == f"{WHEEL}=={WHEEL_VERSION}"
                and ready["packages"] == list(DEBIAN_PACKAGES)
                and install.loader.exists()
                and install.executable.exists()
            ):
                return install
    READY.unlink(missing_ok=True)
    executable = _install_wheel()
    versions = {WHEEL: WHEEL_VERSION, **_install_debian_libraries()}
    library_path = (loader.parent, *_wheel_library_dirs(executable))
    resolved = _resolve(loader, library_path, executable)
    banner = _step(
        "perf_analyzer --version",
        [str(loader), "--library-path", ":".join(map(str, library_path)), str(executable), "--version"],
        timeout=60, stderr=True,  # it prints its banner on standard error
    )
    versions["perf_analyzer --version"] = banner.strip()
    install = Installation(loader, library_path, executable, versions, resolved)
    READY.write_text(json.dumps({
        "wheel": f"{WHEEL}=={WHEEL_VERSION}",
        "packages": list(DEBIAN_PACKAGES),
        "loader": str(loader),
        "library_path": [str(p) for p in library_path],
        "executable": str(executable),
        "versions": versions,
        "resolved": resolved,
    }, indent=2))
    return install


# -- one measurement ----------------------------------------------------------------------


def _host_port(url: str) -> str:
    return re.sub(r"^[a-z]+://", "", url).rstrip("/")


def _number(row: dict[str, str], column: str) -> float:
    try:
        return float(row[column])
    except (KeyError, ValueError) as exc:
        raise PerfAnalyzerError(f"perf_analyzer's CSV has no number in column {column!r}: {row}") from exc


def run(
    *,
    url: str,
    protocol: str,
    model: str,
    concurrency: int,
    measurement_ms: int = 3000,
    shape: list[str] | None = None,
    timeout: float = 120,
    stability_percentage: float = 50,
    max_trials: int = 6,
    extra_args: list[str] | None = None,
) -> dict[str, Any]:
    """One perf_analyzer measurement of ``model`` at ``concurrency`` requests in flight.

    ``url`` is ``host:port`` (a scheme is dropped), ``protocol`` ``"http"`` or ``"grpc"``,
    ``shape`` entries ``NAME:d1,d2`` for inputs with variable dimensions. perf_analyzer
    measures windows of ``measurement_ms`` until three in a row agree within
    ``stability_percentage`` (at most ``max_trials`` windows).

    Returns ``req_per_s``, ``p50_ms``/``p90_ms``/``p99_ms``/``avg_ms`` (client-side latency),
    ``errors`` (always 0: perf_analyzer stops with an error at the first failed request, and
    that raises here), ``requests`` (client requests in the measured windows),
    ``server_requests`` (successful requests by the server's statistics extension),
    ``client_cpu_s`` (user + system CPU time of the perf_analyzer process), ``wall_s`` and
    ``command``. Raises :class:`PerfAnalyzerError` with perf_analyzer's output tail on failure.
    """
    if protocol not in ("http", "grpc"):
        raise PerfAnalyzerError(f"protocol must be 'http' or 'grpc', not {protocol!r}")
    install = setup()
    with tempfile.TemporaryDirectory(prefix="perf_analyzer-") as tmp:
        report = Path(tmp) / "report.csv"
        args = [
            "-m", model,
            "-u", _host_port(url),
            "-i", protocol,
            "--concurrency-range", f"{concurrency}:{concurrency}",
            "--measurement-interval", str(measurement_ms),
            "--stability-percentage", str(stability_percentage),
            "--max-trials", str(max_trials),
            "-f", str(report),
            "--verbose-csv",
        ]
        for item in shape or []:
            args += ["--shape", item]
        args += extra_args or []
        argv = install.argv(args)
        stdout_path, stderr_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        code, usage, wall = _run_measured(argv, stdout_path, stderr_path, timeout)
        stdout = stdout_path.read_text(errors="replace")
        stderr = stderr_path.read_text(errors="replace")
        command = " ".join(argv)
        if code is None:
            raise PerfAnalyzerError(
                f"perf_analyzer did not finish within {timeout:.0f} s (killed): {_tail(stderr + stdout)}"
            )
        if code != 0:
            raise PerfAnalyzerError(f"perf_analyzer exited with {code}: {_tail(stderr or stdout)}")
        if not report.exists():
            raise PerfAnalyzerError(f"perf_analyzer wrote no CSV report: {_tail(stderr + stdout)}")
        with report.open(newline="") as handle:
            rows = [row for row in csv.DictReader(handle) if row.get("Concurrency")]
    if not rows:
        raise PerfAnalyzerError(f"perf_analyzer's CSV report has no row: {_tail(stderr + stdout)}")
    row = rows[0]
    client = re.search(r"Client:\s*\n\s*Request count: (\d+)", stdout)
    server = re.search(r"Successful request count: (\d+)", stdout)
    return {
        "req_per_s": _number(row, "Inferences/Second"),
        "p50_ms": _number(row, "p50 latency") / 1000,
        "p90_ms": _number(row, "p90 latency") / 1000,
        "p99_ms": _number(row, "p99 latency") / 1000,
        "avg_ms": _number(row, "Avg latency") / 1000 if row.get("Avg latency") else None,
        "errors": 0,
        "requests": int(client.group(1)) if client else None,
        "server_requests": int(server.group(1)) if server else None,
        "client_cpu_s": usage.ru_utime + usage.ru_stime,
        "wall_s": wall,
        "warnings": [line.strip() for line in stderr.splitlines() if "WARNING" in line],
        "command": command,
    }


def _run_measured(
    argv: list[str], stdout: Path, stderr: Path, timeout: float
) -> tuple[int | None, resource.struct_rusage, float]:
    """Run ``argv`` in a session of its own; returns (exit code or None if it timed out and was
    killed, its resource usage from wait4, wall seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    with stdout.open("wb") as out, stderr.open("wb") as err:
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                start_new_session=True,
            )
        except OSError as exc:
            raise PerfAnalyzerError(f"could not start perf_analyzer: {exc}") from exc
    deadline = start + timeout
    timed_out = False
    status, usage = 0, None
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.wait4(proc.pid, 0)
        proc.returncode = -signal.SIGKILL
        raise
    wall = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    with contextlib.suppress(ProcessLookupError):  # threads or children that outlived it
        os.killpg(proc.pid, signal.SIGKILL)
    return (None if timed_out else proc.returncode), usage, wall


# -- smoke check --------------------------------------------------------------------------


def main() -> int:
    start = time.monotonic()
    try:
        install = setup()
    except PerfAnalyzerError as exc:
        print(f"setup failed: {exc}", file=sys.stderr)
        return 1
    print(f"setup: {time.monotonic() - start:.1f} s")
    for name, version in install.versions.items():
        print(f"  {name}: {version}")
    print("  command: " + " ".join(install.argv(["..."])))
    for name, where in install.resolved.items():
        print(f"  {name} => {where}")

    from benchmarks.peers.quiver import QuiverPeer

    failures = 0
    with tempfile.TemporaryDirectory(prefix="quiver-perf-analyzer-") as tmp:
        peer = QuiverPeer("onnx", folder=Path(tmp))
        try:
            endpoints = peer.start("tiny")
            print(f"quiver: http {endpoints.http}, grpc {endpoints.grpc}")
            print(
                f"{'protocol':8} {'conc':>4} {'req/s':>9} {'p50 ms':>7} {'p90 ms':>7}"
                f" {'p99 ms':>7} {'client cpu s':>12} {'wall s':>6}"
            )
            results = []
            for protocol in ("http", "grpc"):
                for concurrency in (1, 8):
                    try:
                        result = run(url=str(endpoints.http if protocol == "http" else endpoints.grpc),
                                     protocol=protocol, model="tiny", concurrency=concurrency)
                    except PerfAnalyzerError as exc:
                        failures += 1
                        print(f"{protocol:8} {concurrency:>4} FAILED: {exc}")
                        continue
                    results.append({"protocol": protocol, "concurrency": concurrency, **result})
                    print(
                        f"{protocol:8} {concurrency:>4} {result['req_per_s']:>9.0f} {result['p50_ms']:>7.3f}"
                        f" {result['p90_ms']:>7.3f} {result['p99_ms']:>7.3f} {result['client_cpu_s']:>12.2f}"
                        f" {result['wall_s']:>6.1f}"
                    )
                    for warning in result["warnings"]:
                        print(f"    {warning}")
            print(json.dumps(results, indent=1))
        finally:
            peer.stop()
        errors = [line for line in peer.log.read_text(errors="replace").splitlines() if " E " in line]
        if errors:
            print("quiver logged errors:\n  " + "\n  ".join(errors[-10:]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
