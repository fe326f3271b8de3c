"""The Python backend's server-wide settings: Triton's ``--backend-config=python,KEY=VALUE``
keys (plus Quiver's ``in-process``), checked once when the server starts.

Triton's keys, with Triton's defaults:

- ``shm-default-byte-size``: the shared-memory pool each worker starts with (1 MiB);
- ``shm-growth-byte-size``: how much the pool grows by when a request needs more (1 MiB);
- ``shm-region-prefix-name``: the prefix of the pool's shared-memory names
  (``triton_python_backend_shm_region_``), so several servers on one machine can be told apart;
- ``stub-timeout-seconds``: how long a worker may take to start and run ``initialize`` (30).

Quiver's own:

- ``shm-max-byte-size``: how large one worker's pool may grow (1 GiB); a request or response
  that needs more gets a clear error instead of exhausting ``/dev/shm``;
- ``in-process``: ``true`` runs Python models in the server's process unless their
  configuration says otherwise (the per-model parameter ``QUIVER_PYTHON_IN_PROCESS``);
- ``restart-backoff-seconds`` / ``restart-backoff-max-seconds``: waits before restarting a
  worker that died, doubling each time it dies again without serving (1, 30);
- ``spin-microseconds``: how long a worker waiting for its next batch reads without sleeping (0);
- ``answer-spin-microseconds``: how long the server's idle event loop may keep turning, instead
  of sleeping, for a quick worker's answer (:data:`ANSWER_SPIN_MICROSECONDS`; 0: it sleeps at
  once; see :mod:`quiver.backends.python_worker_spin`);
- ``answer-spin-pressure``: the CPU pressure (percent of the last 10 seconds in which some task
  waited for a CPU, Linux's pressure stall information) above which the server's loop does not
  spin (10; 100: whatever the pressure);
- ``worker-queue-depth``: how many requests of a model without a batcher one worker holds at
  once, the one it runs and those queued behind it (:data:`WORKER_QUEUE_DEPTH`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from quiver.errors import InvalidArgumentError

#: The config.pbtxt parameter that picks the process model of one Python model.
IN_PROCESS_PARAMETER = "QUIVER_PYTHON_IN_PROCESS"

#: ``worker-queue-depth``'s default: requests a worker instance holds at once (1 runs, the rest
#: wait in it), so that it finds its next request there when it finishes one instead of waiting
#: for the server's event loop to send it (see the README's benchmark).
WORKER_QUEUE_DEPTH = 8
#: ``answer-spin-microseconds``' default: the longest the server's idle loop keeps turning for
#: a worker's answer, and the longest recent answers may take on average for it to do so.
ANSWER_SPIN_MICROSECONDS = 300
#: ``worker-queue-depth``'s largest value.
MAX_WORKER_QUEUE_DEPTH = 1024

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


@dataclass(frozen=True, slots=True)
class PythonSettings:
    shm_default_byte_size: int = 1 << 20
    shm_growth_byte_size: int = 1 << 20
    shm_max_byte_size: int = 1 << 30
    shm_region_prefix_name: str = "triton_python_backend_shm_region_"
    stub_timeout_seconds: float = 30.0
    in_process: bool = False
    restart_backoff_seconds: float = 1.0
    restart_backoff_max_seconds: float = 30.0
    #: How long a worker waiting for its next batch reads without sleeping (0, the default: it
    #: sleeps at once).
    spin_microseconds: int = 0
    #: How long the server's idle loop keeps turning for a quick worker's answer (0: it sleeps).
    answer_spin_microseconds: int = ANSWER_SPIN_MICROSECONDS
    #: The CPU pressure (percent) above which it sleeps at once (100: whatever the pressure).
    answer_spin_pressure: float = 10.0
    #: Requests the direct scheduler hands one worker instance at once (a model without
    #: dynamic or sequence batching; decoupled models take one at a time).
    worker_queue_depth: int = WORKER_QUEUE_DEPTH


def parse_bool(value: str, what: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise InvalidArgumentError(f"{what} must be true or false, got '{value}'")


def _size(value: str, key: str, least: int) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        number = -1
    if number < least:
        raise InvalidArgumentError(
            f"--backend-config=python,{key}: expected a number of bytes of at least {least}, "
            f"got '{value}'"
        )
    return number


def _seconds(value: str, key: str) -> float:
    try:
        number = float(value.strip())
    except ValueError:
        number = -1.0
    if not 0 < number < float("inf"):
        raise InvalidArgumentError(
            f"--backend-config=python,{key}: expected a positive number of seconds, got '{value}'"
        )
    return number


def _microseconds(value: str, key: str) -> int:
    value = value.strip()
    if not value.isdigit() or int(value) > 1_000_000:
        raise InvalidArgumentError(
            f"--backend-config=python,{key}: expected a whole number of microseconds from 0 to 1000000, "
            f"got '{value}'"
        )
    return int(value)


def parse_python_settings(config: Mapping[str, str]) -> PythonSettings:
    """The settings ``config`` (the ``python`` backend's ``--backend-config`` keys) gives;
    InvalidArgumentError names a key whose value makes no sense. Keys Quiver does not use are
    ignored, as Triton ignores keys a backend does not read."""
    defaults = PythonSettings()
    prefix = config.get("shm-region-prefix-name", defaults.shm_region_prefix_name).strip()
    if not prefix or "/" in prefix or len(prefix) > 200 or not prefix.isprintable():
        raise InvalidArgumentError(
            "--backend-config=python,shm-region-prefix-name: expected a name without '/' "
            f"(at most 200 characters), got '{prefix}'"
        )
    default_size = _size(config.get("shm-default-byte-size", str(defaults.shm_default_byte_size)),
                         "shm-default-byte-size", 4096)  # fmt: skip
    growth = _size(config.get("shm-growth-byte-size", str(defaults.shm_growth_byte_size)),
                   "shm-growth-byte-size", 1)  # fmt: skip
    largest = _size(config.get("shm-max-byte-size", str(max(defaults.shm_max_byte_size, default_size))),
                    "shm-max-byte-size", default_size)  # fmt: skip
    backoff = _seconds(config.get("restart-backoff-seconds", "1"), "restart-backoff-seconds")
    backoff_max = _seconds(config.get("restart-backoff-max-seconds", "30"), "restart-backoff-max-seconds")
    spin = _microseconds(config.get("spin-microseconds", str(defaults.spin_microseconds)), "spin-microseconds")
    answer_spin = _microseconds(
        config.get("answer-spin-microseconds", str(defaults.answer_spin_microseconds)), "answer-spin-microseconds"
    )
    pressure_text = config.get("answer-spin-pressure", f"{defaults.answer_spin_pressure:g}").strip()
    try:
        pressure = float(pressure_text)
    except ValueError:
        pressure = -1.0
    if not 0 <= pressure <= 100:
        raise InvalidArgumentError(
            f"--backend-config=python,answer-spin-pressure: expected a percentage from 0 to 100, got '{pressure_text}'"
        )
    depth = config.get("worker-queue-depth", str(defaults.worker_queue_depth)).strip()
    if not depth.isdigit() or not 1 <= int(depth) <= MAX_WORKER_QUEUE_DEPTH:
        raise InvalidArgumentError(
            f"--backend-config=python,worker-queue-depth: expected a whole number of requests from 1 to "
            f"{MAX_WORKER_QUEUE_DEPTH}, got '{depth}'"
        )
    return PythonSettings(
        spin_microseconds=spin,
        answer_spin_microseconds=answer_spin,
        answer_spin_pressure=pressure,
        worker_queue_depth=int(depth),
        shm_default_byte_size=default_size,
        shm_growth_byte_size=growth,
        shm_max_byte_size=largest,
        shm_region_prefix_name=prefix,
        stub_timeout_seconds=_seconds(config.get("stub-timeout-seconds", "30"), "stub-timeout-seconds"),
        in_process=parse_bool(config.get("in-process", "false"), "--backend-config=python,in-process"),
        restart_backoff_seconds=backoff,
        restart_backoff_max_seconds=max(backoff, backoff_max),
    )
