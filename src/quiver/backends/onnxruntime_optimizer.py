"""The process that optimizes ONNX models for :mod:`quiver.backends.onnxruntime_optimized`.

The server starts it (``python -P .../onnxruntime_optimizer.py``) when a model was loaded
whose optimized graph is not kept yet; it runs at the CPU's idle priority (``SCHED_IDLE``,
else nice 19), so it takes a core only when nothing else wants one. It reads
one job a line on standard input (JSON: ``source``, ``target``, ``temporary``, ``level``),
creates an ONNX Runtime session of ``source`` at ``level`` with ONNX Runtime's
``optimized_model_filepath`` set to ``temporary`` (in an empty folder of its own), opens that
copy without optimizations (so a graph naming external data files, which are not beside it,
is not kept), renames it to ``target``, and answers one line (JSON: ``ok``, and
``error`` when not). It ends at the end of its input, and with the server
(``PR_SET_PDEATHSIG``).

It runs apart from the server so that the optimization takes none of the server's memory
(whose growth measures the models' footprints), none of its GIL, and a model that crashes
ONNX Runtime's optimizer crashes this process only. Standard library and onnxruntime only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(ImportError, OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _optimize(ort: Any, job: dict[str, Any]) -> None:
    levels = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    temporary = str(job["temporary"])
    options = ort.SessionOptions()
    options.graph_optimization_level = levels[str(job["level"])]
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.optimized_model_filepath = temporary
    try:
        ort.InferenceSession(str(job["source"]), sess_options=options, providers=["CPUExecutionProvider"])
        check = ort.SessionOptions()  # the copy opens on its own: in its empty folder, a graph
        check.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # that names
        check.intra_op_num_threads = 1  # external data files fails here, and is not kept
        check.inter_op_num_threads = 1
        check.log_severity_level = 3
        ort.InferenceSession(temporary, sess_options=check, providers=["CPUExecutionProvider"])
        os.replace(temporary, str(job["target"]))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def main() -> None:
    _die_with_parent(int(os.environ.get("QUIVER_OPTIMIZER_PARENT", os.getppid())))
    # the server's requests come first: this runs only on a core nothing else wants
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    with contextlib.suppress(OSError):
        os.nice(19)
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as file:
        file.write("1000")  # out of memory, this goes before the server
    import onnxruntime as ort

    for line in sys.stdin:
        try:
            job = json.loads(line)
            _optimize(ort, job)
            answer: dict[str, Any] = {"ok": True}
        except Exception as exc:  # onnxruntime raises its own types; the server logs the text
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
