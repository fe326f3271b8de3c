"""What the benchmark scripts share: the machine and versions they report, the command line
that made a result, the event loop they drive clients on, a process's CPU time, and the
throwaway venv with matplotlib that draws their plots."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is a dependency of quiver
    psutil = None

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

#: matplotlib for the plots, which the project does not depend on: a venv of its own, made on
#: first use (git ignores benchmarks/.work).
PLOTVENV = Path(__file__).resolve().parent / ".work" / "plotvenv"


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment(packages: Iterable[str]) -> dict[str, Any]:
    """Date, cores, CPU model, platform, Python, and the versions of ``packages``."""
    cpu_model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        **{name: version(name) for name in packages},
    }


def command_line() -> str:
    """The command that is running, as a reader would type it again."""
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(Path.cwd())
    return shlex.join(["python", str(script), *sys.argv[1:]])


def run_async(coro: Any) -> Any:
    """Run ``coro`` on uvloop when it is installed (the client then costs less CPU)."""
    if uvloop is not None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live children."""
    if psutil is not None:
        proc = psutil.Process(pid)
        total = float(sum(proc.cpu_times()[:2]))
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += sum(child.cpu_times()[:2])
        return total
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plot_in_venv(script: Path, json_path: Path, png: Path | None = None) -> str:
    """Run ``python SCRIPT --plot-from JSON`` in :data:`PLOTVENV` (made with ``pip install
    matplotlib`` on first use), which draws the PNG beside the JSON, or with ``png`` adds
    ``--png PNG`` (the script then draws it there). Returns what happened, for the log: the
    PNG written, or why it was skipped."""
    python = PLOTVENV / "bin" / "python"
    setup_log = PLOTVENV.parent / "plotvenv.log"
    probe = [str(python), "-c", "import matplotlib"]
    if not python.exists() or subprocess.run(probe, capture_output=True).returncode != 0:
        print(f"plot: making {PLOTVENV} (pip install matplotlib) ...", file=sys.stderr, flush=True)
        PLOTVENV.parent.mkdir(parents=True, exist_ok=True)
        with setup_log.open("ab") as out:
            for argv in ([sys.executable, "-m", "venv", str(PLOTVENV)],
                         [str(python), "-m", "pip", "install", "--quiet", "matplotlib"]):
                if subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                    return f"skipped: `{' '.join(argv[-3:])}` failed (see {setup_log})"
    argv = [str(python), str(script), "--plot-from", str(json_path)]
    if png is not None:
        argv += ["--png", str(png)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        return f"skipped: the plotting step failed: {done.stderr.strip()[-300:]}"
    return f"wrote {png if png is not None else json_path.with_suffix('.png')}"
