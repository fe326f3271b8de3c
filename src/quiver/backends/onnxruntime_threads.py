"""Where ONNX Runtime sessions get their threads: each its own pools, or the process's shared ones.

By default ONNX Runtime gives every session its own intra-op (and, in parallel execution
mode, inter-op) thread pool, sized to the machine's cores. With hundreds of models loaded
(the multi-model endpoint) that is hundreds of pools on the same cores, and every load and
unload creates or joins a pool's threads: on a busy 2-core machine, freeing one session of a
tiny model took 2.5 ms at the median and 13 ms at the 90th percentile, and spinning pools
slowed the loads around them. Triton's onnxruntime backend offers global thread pools
instead, shared by every session of the process; Quiver reads the same settings:

- ``--backend-config=onnxruntime,enable-global-threadpool=<0|1>``: share the process's
  pools (``1``) or give each session its own (``0``). Unset, Quiver shares them in the
  ``on_demand`` model control mode (the multi-model endpoint, :mod:`quiver.settings`) and
  does not otherwise, as Triton.
- ``--backend-config=onnxruntime,intra_op_thread_count=<n>`` and ``inter_op_thread_count``:
  the shared pools' sizes (0, the default: ONNX Runtime's choice, the physical cores). As in
  Triton, a model's own ``intra_op_thread_count`` / ``inter_op_thread_count`` parameters do
  not apply while the pools are shared (a log line says so at its load).

The choice is made once per process, at the first session (ONNX Runtime cannot change it
afterwards), from the server's backend settings (:data:`quiver.backends.base.SERVER`).
Importing this module does not import onnxruntime (the settings check the keys at start).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from quiver.backends.base import SERVER

if TYPE_CHECKING:
    import onnxruntime as ort

__all__ = [
    "GLOBAL_THREADPOOL",
    "INTER_OP_THREADS",
    "INTRA_OP_THREADS",
    "KEYS",
    "check_settings",
    "metadata_options",
    "shares_thread_pools",
]

logger = logging.getLogger(__name__)

#: ``--backend-config=onnxruntime,<key>=<value>`` keys read here (Triton's names).
GLOBAL_THREADPOOL = "enable-global-threadpool"
INTRA_OP_THREADS = "intra_op_thread_count"
INTER_OP_THREADS = "inter_op_thread_count"
KEYS = frozenset({GLOBAL_THREADPOOL, INTRA_OP_THREADS, INTER_OP_THREADS})

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")

_lock = threading.Lock()
_decided: list[bool] = []  # [shared] once the first session asked


def check_settings(settings: Mapping[str, str]) -> None:
    """The onnxruntime backend settings, checked: ValueError names the key and the value."""
    flag = settings.get(GLOBAL_THREADPOOL)
    if flag is not None and flag.strip().lower() not in _TRUE + _FALSE:
        raise ValueError(
            f"onnxruntime,{GLOBAL_THREADPOOL}={flag}: use 1 (shared thread pools) or 0 (one per session)"
        )
    for key in (INTRA_OP_THREADS, INTER_OP_THREADS):
        value = settings.get(key)
        if value is not None and not (value.strip().isdigit()):
            raise ValueError(
                f"onnxruntime,{key}={value}: a number of threads, 0 or more (0: ONNX Runtime's choice)"
            )


def shares_thread_pools() -> bool:
    """Whether this process's sessions share its global thread pools (decided, and the pools
    created, at the first call: before the first session)."""
    if _decided:
        return _decided[0]
    with _lock:
        if not _decided:
            _decided.append(_start())
    return _decided[0]


def _start() -> bool:
    settings = SERVER.backend_config.get("onnxruntime", {})
    try:
        check_settings(settings)
    except ValueError as exc:  # settings are checked at start; a server built in code may not be
        logger.warning("%s; each onnxruntime session gets its own thread pools", exc)
        return False
    if settings.get(GLOBAL_THREADPOOL, "0").strip().lower() not in _TRUE:
        return False
    import onnxruntime as ort

    intra = int(settings.get(INTRA_OP_THREADS, "0") or 0)
    inter = int(settings.get(INTER_OP_THREADS, "0") or 0)
    try:
        ort.set_global_thread_pool_sizes(intra, inter)
    except Exception as exc:  # onnxruntime raises its own Fail type
        if "already been created" not in str(exc):
            logger.warning(
                "onnxruntime could not create its global thread pools (%s); each session gets its own",
                exc,
            )
            return False
    logger.info(
        "onnxruntime sessions share the process's thread pools (%s intra-op, %s inter-op threads; "
        "--backend-config=onnxruntime,%s=0 gives each session its own)",
        intra or "default", inter or "default", GLOBAL_THREADPOOL,
    )  # fmt: skip
    return True


def metadata_options() -> ort.SessionOptions:
    """Options for a session opened only to read a model's inputs and outputs (auto-complete)
    or to pay the framework's one-time cost: no thread pool of its own (creating one, and
    joining its threads when the session goes, costs milliseconds on a busy machine) and no
    graph optimization (the graph's inputs and outputs do not depend on it)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if shares_thread_pools():
        options.use_per_session_threads = False
    else:
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return options
