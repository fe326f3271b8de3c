"""What the benchmarks share: the machine and versions they report, the command line that made
a result, the event loop they drive clients on, a process's CPU time, a server's metrics, the
test suite's model builders, and the throwaway venv with matplotlib that draws their plots.

The benchmarks are modules of the package ``benchmarks``, run from the repository root
(``python -m benchmarks.soak``): the root is then on ``sys.path``, so ``benchmarks.*`` and the
example builder (``examples.build_repository``) import as they are; the test suite's helpers
come through :func:`test_support`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is a dependency of quiver
    psutil = None

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

ROOT = Path(__file__).resolve().parents[1]
#: matplotlib for the plots, which the project does not depend on: a venv of its own, made on
#: first use (git ignores benchmarks/.work).
PLOTVENV = ROOT / "benchmarks" / ".work" / "plotvenv"


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


def source_variants(parser: argparse.ArgumentParser, specs: list[str], default: Path) -> dict[str, str]:
    """``--src NAME=DIR`` values as {name: the resolved src folder}; one variant, ``this``, at
    ``default`` when none is given. A DIR without a ``quiver`` package is a usage error."""
    variants = {}
    for spec in specs or [f"this={default}"]:
        name, _, folder = spec.partition("=")
        if not folder or not (Path(folder) / "quiver").is_dir():
            parser.error(f"--src {spec!r}: want NAME=DIR with DIR/quiver a package")
        variants[name] = str(Path(folder).resolve())
    return variants


def command_line() -> str:
    """The command that is running, as a reader would type it again (``python -m
    benchmarks.soak ...``; a script run as a file by its path)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name:
        return shlex.join(["python", "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]])
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


#: ``model.py`` of :func:`ballast_model`.
BALLAST_MODEL = """import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.ballast = np.full({weight_mb} * 1024 * 1024 // 4, {value}, dtype=np.float32)  # touched: resident{record}

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x + self.ballast[0])]))
        return responses
"""

BALLAST_RECORD = """
        with open({log!r}, "a") as log:
            log.write(args["model_name"] + " " + str(os.getpid()) + "\\n")"""


def ballast_model(weight_mb: int, value: float, load_log: Path | None = None) -> str:
    """``model.py`` of a Triton Python model that holds ``weight_mb`` MiB of memory (touched, so
    resident) and answers ``OUTPUT0 = INPUT0 + value``; with ``load_log``, each load appends
    "MODEL_NAME PID" to that file."""
    record = "" if load_log is None else BALLAST_RECORD.format(log=str(load_log))
    return BALLAST_MODEL.format(weight_mb=weight_mb, value=value, record=record)


def trial_settings(args: Any) -> dict[str, Any]:
    """The settings every load generator trial of a run shares, for its JSON: concurrency levels,
    measured and warm-up seconds."""
    return {"concurrency": args.concurrency, "duration_s": args.duration, "warmup_s": args.warmup}


def dash(value: float | None, spec: str = "") -> str:
    """``value`` formatted by ``spec`` for a table, or "-" when there is none."""
    return "-" if value is None else format(value, spec)


def markdown_table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """A markdown table's lines; ``align``: one letter per column, ``r`` right-aligned, any
    other left (default: the first column left, the rest right)."""
    spec = align or "l" + "r" * (len(header) - 1)
    marks = ["---:" if a == "r" else "---" for a in spec]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def write_results(out: Path, stem: str, markdown: str, report: dict[str, Any]) -> str:
    """``OUT/STEM.md`` (the report a reader reads) and ``OUT/STEM.json`` (everything); returns
    what was written, for the log."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(markdown.rstrip("\n") + "\n")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    return f"wrote {out / f'{stem}.md'} and {out / f'{stem}.json'}"


def scrape(url: str, names: Iterable[str], timeout: float = 30.0) -> dict[str, float]:
    """The unlabelled samples called ``names`` on a Prometheus page (absent ones left out)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    found = {}
    for name in names:
        match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        if match:
            found[name] = float(match.group(1))
    return found


def test_support(module: str) -> ModuleType:
    """``tests/support/MODULE.py`` (the test suite's model builders, its SeaweedFS launcher),
    imported as the tests import it: as ``support.MODULE``, its modules importing each other by
    that name. The package ``tests/support`` is registered under the name ``support`` from its
    file (rather than putting ``tests`` on ``sys.path``, which would make everything there
    importable)."""
    if "support" not in sys.modules:
        folder = ROOT / "tests" / "support"
        spec = importlib.util.spec_from_file_location("support", folder / "__init__.py", submodule_search_locations=[str(folder)])
        assert spec is not None and spec.loader is not None
        package = importlib.util.module_from_spec(spec)
        sys.modules["support"] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"support.{module}")


def plot_in_venv(kind: str, json_path: Path, png: Path) -> str:
    """Draw ``png`` from a benchmark's JSON: ``python -m benchmarks.plots KIND JSON PNG`` in
    :data:`PLOTVENV` (made with ``pip install matplotlib`` on first use). Returns what happened,
    for the log: the PNG written, or why it was skipped."""
    from benchmarks.peers import PeerError, make_venv

    if not (PLOTVENV / "bin" / "python").exists():
        print(f"plot: making {PLOTVENV} (pip install matplotlib) ...", file=sys.stderr, flush=True)
    try:
        python = make_venv(PLOTVENV, ["matplotlib"], PLOTVENV.parent / "plotvenv.log")
    except PeerError as exc:
        return f"skipped: {exc}"
    argv = [str(python), "-m", "benchmarks.plots", kind, str(json_path.resolve()), str(png.resolve())]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return f"skipped: the plotting step failed: {done.stderr.strip()[-300:]}"
    return f"wrote {png}"


def plot_from(kind: str, json_path: Path, png: Path) -> int:
    """A benchmark's ``--plot-from JSON``: :func:`plot_in_venv`, said on stderr; the exit status."""
    done = plot_in_venv(kind, json_path, png)
    print(f"plot: {done}", file=sys.stderr)
    return 0 if done.startswith("wrote") else 1
