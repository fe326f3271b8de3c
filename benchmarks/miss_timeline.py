"""Where a miss's time goes: a per-request timeline of ``quiver serve`` on the multi-model
trace, next to a timeline of the in-process floor on the same trace.

The server runs as ``benchmarks.multi_model`` runs it (same models, flags, budget and trace;
the same client: a readiness check before each request, ``/metrics`` read and a
:data:`~benchmarks.multi_model.SETTLE_S` pause after each miss), but in a probe
(:func:`probe_main`) that wraps the functions a request and a miss go through with
``perf_counter_ns`` stamps (and the thread's CPU time) before the server starts: the HTTP
protocol receiving bytes, the inference route, the miss's wait, the flight task, each trip to a
load thread and its hand-off back, the find / inspect / admission / measured section / config /
session / first-call guess / scheduler steps of the load, the bookkeeping, the first
execution and the answer; besides, everything else that ran meanwhile (unloads, evictions ahead
of need, heap trims, configurations read ahead, garbage collections). The client stamps with the
same clock (``CLOCK_MONOTONIC``, which ``perf_counter`` reads on Linux), so a request's timeline
runs from the client sending it to the client reading its answer. The probe adds a microsecond
or two per stamp, on hits and misses alike.

The floor is :func:`benchmarks.multi_model.replayed_floor`'s replay with the session's
creation and its first run stamped apart, in a process of its own, with the session options
the server used (read from the server: the probe records them at its first session).

Run: ``python -m benchmarks.miss_timeline [--requests 2000]``; writes
``benchmarks/results/miss_timeline.{md,json}`` (``--output-dir``). Not a target's benchmark: a
tool to find what to cut.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import gc
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import ROOT
from benchmarks.multi_model import MB, SETTLE_S, build, metrics, post, ready
from benchmarks.peers.quiver import QuiverServer

RESULTS = ROOT / "benchmarks" / "results"

# -- the probe (runs inside the server) ------------------------------------------------------------

#: (perf_counter_ns, thread CPU ns, event, key, thread id)
EVENTS: list[tuple[int, int, str, str, int]] = []
OPTIONS: dict[str, Any] = {}
#: glibc's malloc state when the last request was answered (free chunks, arenas: what a heap reading walks)
HEAP: dict[str, Any] = {}


def _heap_state() -> None:
    import ctypes

    from quiver.lifecycle import memory

    function = memory._load_libc_function("mallinfo2")
    if function is None:
        return
    function.restype = memory._MallInfo2  # type: ignore[attr-defined]
    t0 = time.perf_counter_ns()
    info = function()
    HEAP["mallinfo2_hot_us"] = (time.perf_counter_ns() - t0) / 1e3
    HEAP.update({name: int(getattr(info, name)) for name, _ in memory._MallInfo2._fields_})
    libc = ctypes.CDLL("libc.so.6")
    libc.open_memstream.restype = ctypes.c_void_p
    buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    text = ctypes.string_at(buffer, size.value).decode()
    HEAP["arenas"] = text.count("<heap nr=")
    HEAP["malloc_info"] = text[:20000]


def _stamp(event: str, key: str = "") -> None:
    EVENTS.append((time.perf_counter_ns(), time.thread_time_ns(), event, key, threading.get_ident()))


def _wrap(owner: Any, attr: str, label: str, key: Callable[..., str] | None = None) -> None:
    """``owner.attr`` stamped ``label<`` on entry and ``label>`` on exit (sync or async)."""
    original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    import inspect

    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            k = key(*args, **kwargs) if key else ""
            _stamp(label + "<", k)
            try:
                return await original(*args, **kwargs)
            finally:
                _stamp(label + ">", k)

        setattr(owner, attr, wrapped_async)
        return

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        k = key(*args, **kwargs) if key else ""
        _stamp(label + "<", k)
        try:
            return original(*args, **kwargs)
        finally:
            _stamp(label + ">", k)

    setattr(owner, attr, wrapped)


def install_probe(fine: bool) -> None:
    """Wrap the functions a request and a miss go through (see the module notes); ``fine``:
    the steps inside them too (each function's own time in the report's last table)."""
    from quiver.backends import base, onnxruntime
    from quiver.frontends import http, http_exchange, http_server
    from quiver.lifecycle import (
        admission,
        ahead,
        lifecycle,
        loader,
        manager,
        memory,
        pool,
        read_ahead,
        sources,
        table,
    )
    from quiver.lifecycle import flights as flights_module

    def model_arg(_self: Any, _scope: Any, _receive: Any, _send: Any, model: str, *_: Any) -> str:
        return model

    _wrap(http_server.HttpProtocol, "data_received", "recv")
    _wrap(http.HttpFrontend, "_infer_traced", "route", model_arg)
    _wrap(http_exchange.Exchange, "respond", "respond")
    _wrap(manager.ModelRepositoryManager, "stop", "stop")
    stop = manager.ModelRepositoryManager.stop

    async def stop_after_reading_heap(self: Any) -> None:
        _heap_state()
        await stop(self)

    manager.ModelRepositoryManager.stop = stop_after_reading_heap  # type: ignore[method-assign]
    _wrap(manager.ModelRepositoryManager, "acquire", "acquire", lambda _s, name, *a, **k: name)
    _wrap(manager.ModelRepositoryManager, "_load_on_demand", "flight", lambda _s, name: name)
    _wrap(lifecycle.ModelLifeCycle, "load_on_demand", "on_demand", lambda _s, name, _f: name)
    _wrap(lifecycle.ModelLifeCycle, "load_locked", "load_locked", lambda _s, src, *a, **k: src.name)
    _wrap(pool.LoadPool, "run", "pool", lambda _s, fn, *a, **k: getattr(fn, "__name__", type(fn).__name__))
    _wrap(pool, "_deliver", "deliver")
    _wrap(lifecycle, "find_and_load", "trip")
    _wrap(lifecycle, "settle_trip", "settle")
    if hasattr(lifecycle, "settle_trip_now"):  # settled as the trip's result arrives
        _wrap(lifecycle, "settle_trip_now", "settle")
    _wrap(sources.ModelSources, "find", "find")
    _wrap(admission.AdmissionControl, "inspect", "inspect")
    _wrap(admission.AdmissionControl, "measure", "measure")
    _wrap(lifecycle, "load_model", "load_model")
    _wrap(loader, "_prepare", "prepare")
    _wrap(loader, "_load_version", "version")
    _wrap(loader, "build_warmup_samples", "samples")
    _wrap(loader, "run_warmup", "warmup")
    _wrap(loader, "create_scheduler", "scheduler")
    _wrap(onnxruntime, "_open_session", "session")
    _wrap(onnxruntime, "_check_io", "check_io")
    _wrap(onnxruntime.OnnxRuntimeBackend, "create_instance", "instance")
    _wrap(table.ModelTable, "install", "install")
    _wrap(flights_module.SingleFlight, "_wake", "wake")
    _wrap(base.ThreadedInstance, "_timed", "execute")
    _wrap(lifecycle, "unload_instances", "unload")
    _wrap(lifecycle, "release_free_memory", "trim")
    _wrap(loader, "release_free_memory", "trim")
    _wrap(lifecycle.ModelLifeCycle, "evict", "evict", lambda _s, victim, *a, **k: victim)
    _wrap(ahead.RoomAhead, "make", "ahead")
    _wrap(read_ahead, "read_config", "read_ahead", lambda source, *a: source.name)
    # the path of a model addressed by key (an archive in S3, through the disk cache)
    from quiver.repository import cache

    _wrap(lifecycle.ModelLifeCycle, "load_archive", "archive", lambda _s, served, *a, **k: served)
    _wrap(lifecycle.ModelLifeCycle, "load", "load", lambda _s, source, *a, **k: source.name)
    from quiver.lifecycle import archives

    _wrap(archives.ArchiveLayouts, "read", "layout")
    _wrap(sources.ModelSources, "scan", "scan")
    _wrap(sources.ModelSources, "fetch", "fetch", lambda _s, served, *a, **k: served)
    _wrap(cache.DiskCache, "_usable", "cache_check")
    _wrap(cache.DiskCache, "_download", "download")
    _wrap(admission.AdmissionControl, "load", "admission_load", lambda _s, source, *a, **k: source.name)

    if fine:
        from quiver.backends import base as backends_base
        from quiver.lifecycle import budget, pins, tinylfu
        from quiver.scheduling import direct

        _wrap(admission, "fingerprint_and_size", "fine.fingerprint")
        _wrap(admission, "composing_of", "fine.composing_of")
        _wrap(admission, "backend_name", "fine.backend_name")
        _wrap(admission.AdmissionControl, "primed", "fine.primed")
        _wrap(lifecycle.ModelLifeCycle, "_loader", "fine.loader_partial")
        _wrap(memory.SizePredictor, "predict", "fine.predict")
        _wrap(budget.MemoryBudget, "fits", "fine.fits")
        _wrap(budget.MemoryBudget, "admit", "fine.admit")
        _wrap(budget.MemoryBudget, "commit", "fine.commit")
        _wrap(memory.MemoryMeter, "_gpu_now", "fine.gpu_now")
        _wrap(loader, "get_backend", "fine.get_backend")
        _wrap(loader, "instance_specs", "fine.instance_specs")
        _wrap(onnxruntime, "_session_options", "fine.session_options")
        _wrap(onnxruntime.OnnxInstance, "__init__", "fine.instance_init")
        _wrap(backends_base.ThreadedInstance, "__init__", "fine.threaded_init")
        _wrap(admission.AdmissionControl, "settle", "fine.admission_settle")
        _wrap(admission.AdmissionControl, "_cover_overrun", "fine.cover_overrun")
        _wrap(admission.AdmissionControl, "room_ahead_short", "fine.room_ahead_short")
        _wrap(lifecycle.ModelLifeCycle, "_load_inner", "fine.load_inner")
        _wrap(table.ModelTable, "mark_loading", "fine.mark_loading")
        _wrap(table.ModelTable, "mark", "fine.mark")
        _wrap(table.ModelTable, "get", "fine.table_get")
        _wrap(sources.ModelSources, "remember_fingerprint", "fine.remember_fingerprint")
        _wrap(pins.Pins, "pin", "fine.pin")
        _wrap(pins.Pins, "unpin", "fine.unpin")
        _wrap(flights_module.SingleFlight, "join", "fine.flight_join")
        _wrap(flights_module.SingleFlight, "wait", "fine.flight_wait")
        _wrap(direct.DirectScheduler, "__init__", "fine.direct_scheduler")
        _wrap(tinylfu.WTinyLFUPolicy, "touch", "fine.policy_touch")
        _wrap(memory._SharedExclusiveLock, "exclusive", "fine.exclusive_cm")
        _wrap(memory, "Footprint", "fine.footprint")
        init = memory.MemoryMeter.__init__

        def meter_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if self._heap is not None:
                _wrap(self, "_heap", "fine.heap_read")

        memory.MemoryMeter.__init__ = meter_init  # type: ignore[method-assign]
        _wrap(manager.ModelRepositoryManager, "request_done", "fine.request_done")
        _wrap(cache.DiskCache, "_get", "fine.cache_get")
        _wrap(cache.DiskCache, "_newest", "fine.cache_newest")
        _wrap(cache, "check_key", "fine.check_key")
        _wrap(sources.ModelSources, "_disk_cache", "fine.disk_cache")

    measure = memory.MemoryMeter.measure

    def measure_stamped(self: Any, load: Callable[[], Any], *, heap: bool = False) -> Any:
        _stamp("meter<")

        def stamped() -> Any:
            _stamp("meter.in")
            try:
                return load()
            finally:
                _stamp("meter.out")

        return measure(self, stamped, heap=heap)

    memory.MemoryMeter.measure = measure_stamped  # type: ignore[method-assign]

    options = onnxruntime._session_options

    def options_recorded(*args: Any, **kwargs: Any) -> Any:
        made = options(*args, **kwargs)
        if not OPTIONS:
            OPTIONS.update(session_options(made))
        return made

    onnxruntime._session_options = options_recorded  # type: ignore[assignment]

    def collected(phase: str, info: dict[str, Any]) -> None:
        _stamp("gc<" if phase == "start" else "gc>", str(info.get("generation", "")))

    gc.callbacks.append(collected)


def session_options(options: Any) -> dict[str, Any]:
    """The fields of an ``onnxruntime.SessionOptions`` that change how a session is made and runs."""
    fields = (
        "use_per_session_threads", "intra_op_num_threads", "inter_op_num_threads", "execution_mode",
        "graph_optimization_level", "enable_cpu_mem_arena", "enable_mem_pattern", "enable_mem_reuse",
        "log_severity_level", "execution_order", "enable_profiling",
    )  # fmt: skip
    found = {name: str(getattr(options, name)) for name in fields if hasattr(options, name)}
    for entry in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning", "session.use_env_allocators"):
        try:
            found[entry] = options.get_session_config_entry(entry)
        except Exception:
            found[entry] = None
    return found


def probe_main(argv: list[str]) -> int:
    """``python -m benchmarks.miss_timeline --probe OUT.json serve ...``: ``quiver`` with the
    probe installed; the events are written to OUT.json when it exits."""
    out = Path(argv[0])
    fine = argv[1] == "--fine"
    install_probe(fine)
    if fine:
        argv = argv[1:]

    def dump() -> None:
        out.write_text(json.dumps({"events": EVENTS, "options": OPTIONS, "threads": _thread_names(), "heap": HEAP}))

    atexit.register(dump)
    from quiver.cli import main as quiver_main

    code = quiver_main(argv[1:])
    dump()
    return code


def _thread_names() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate() if t.ident is not None}


# -- the floor with stamps -------------------------------------------------------------------------


def floor_timeline(repo: Path, trace: list[str], room: int, options: dict[str, Any]) -> list[dict[str, float]]:
    """:func:`benchmarks.multi_model.replayed_floor` with the creation and the first run timed
    apart (wall and CPU, microseconds), sessions made with the server's ``options``."""
    import numpy as np
    import onnxruntime as ort

    from benchmarks.multi_model import FLOOR_REPLAY_REQUESTS

    ort.set_global_thread_pool_sizes(0, 0)
    feed = {"INPUT0": np.arange(4, dtype=np.float32).reshape(1, 4)}
    levels = {str(v): v for v in (
        ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    )}  # fmt: skip
    modes = {str(v): v for v in (ort.ExecutionMode.ORT_SEQUENTIAL, ort.ExecutionMode.ORT_PARALLEL)}

    def made() -> Any:
        made = ort.SessionOptions()
        made.use_per_session_threads = options.get("use_per_session_threads", "False") == "True"
        made.log_severity_level = int(options.get("log_severity_level", 3))
        if "graph_optimization_level" in options:
            made.graph_optimization_level = levels[options["graph_optimization_level"]]
        if "execution_mode" in options:
            made.execution_mode = modes[options["execution_mode"]]
        made.enable_cpu_mem_arena = options.get("enable_cpu_mem_arena", "True") == "True"
        return made

    kept: OrderedDict[str, Any] = OrderedDict()
    rows = []
    for name in trace[:FLOOR_REPLAY_REQUESTS]:
        session = kept.get(name)
        if session is not None:
            kept.move_to_end(name)
            session.run(None, feed)
            continue
        path = str(repo / name / "1" / "model.onnx")
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        session = ort.InferenceSession(path, sess_options=made(), providers=["CPUExecutionProvider"])
        c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
        session.run(None, feed)
        c2, t2 = time.thread_time_ns(), time.perf_counter_ns()
        rows.append({
            "create_us": (t1 - t0) / 1e3, "create_cpu_us": (c1 - c0) / 1e3,
            "run_us": (t2 - t1) / 1e3, "run_cpu_us": (c2 - c1) / 1e3, "total_us": (t2 - t0) / 1e3,
        })  # fmt: skip
        kept[name] = session
        del session
        while len(kept) > room:
            kept.popitem(last=False)
        time.sleep(SETTLE_S)
    kept.clear()
    return rows


# -- the client ------------------------------------------------------------------------------------


def replay_stamped(http: str, metrics_url: str, trace: list[str], value_of: dict[str, int]) -> list[dict[str, Any]]:
    """:func:`benchmarks.multi_model.replay`'s client, each request's send and answer stamped
    with ``perf_counter_ns``."""
    import numpy as np

    x = np.arange(4, dtype=np.float32)
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": x.tolist()}]}
    ).encode()
    rows = []
    for index, name in enumerate(trace):
        loaded = ready(http, name)
        t0 = time.perf_counter_ns()
        answer = post(f"http://{http}/v2/models/{name}/infer", body)
        t1 = time.perf_counter_ns()
        if answer["outputs"][0]["data"] != (x + value_of[name]).tolist():  # type: ignore[index]
            raise RuntimeError(f"wrong answer from {name}")
        rows.append({"name": name, "hit": loaded, "sent": t0, "answered": t1})
        if not loaded:
            metrics(metrics_url)
            time.sleep(SETTLE_S)
        if index % 500 == 0:
            print(f"[miss-timeline] {index}/{len(trace)}", file=sys.stderr, flush=True)
    return rows


# -- the analysis ----------------------------------------------------------------------------------

#: The stages of a miss: (label, from event, to event); each the time from the first ``from``
#: stamp to the first ``to`` stamp after it within the request (``>`` ends, ``<`` starts).
MISS_STAGES = [
    ("client send -> server reads the request", "sent", "recv<"),
    ("read -> inference route", "recv<", "route<"),
    ("route -> miss noticed (acquire)", "route<", "acquire<"),
    ("acquire -> flight task runs", "acquire<", "flight<"),
    ("flight -> trip handed to a load thread", "flight<", "pool<"),
    ("hand-off: pool.run -> trip starts on the load thread", "pool<", "trip<"),
    ("find the folder", "find<", "find>"),
    ("inspect (fingerprint, config, size)", "inspect<", "inspect>"),
    ("inspect -> measured section entered", "inspect>", "meter.in"),
    ("prepare the configuration", "prepare<", "prepare>"),
    ("prepare -> session creation starts", "prepare>", "session<"),
    ("ONNX Runtime session created", "session<", "session>"),
    ("check the session's inputs and outputs", "check_io<", "check_io>"),
    ("instance made -> warm-up / scheduler done", "instance>", "scheduler>"),
    ("version loaded -> measured section left", "version>", "meter.out"),
    ("measured section left -> trip ends", "meter.out", "trip>"),
    ("hand-off: trip ends -> event loop has the result", "trip>", "deliver<"),
    ("result -> settled (budget commit)", "deliver<", "settle>"),
    ("settled -> install", "settle>", "install<"),
    ("install -> waiters woken (the model landed)", "install<", "wake>"),
    ("woken -> acquire returns", "wake>", "acquire>"),
    ("acquire returns -> first execution starts", "acquire>", "execute<"),
    ("first execution (Run and its outputs)", "execute<", "execute>"),
    ("execution -> answer written", "execute>", "respond<"),
    ("answer written -> client has it", "respond>", "answered"),
]
HIT_STAGES = [
    ("client send -> server reads the request", "sent", "recv<"),
    ("read -> inference route", "recv<", "route<"),
    ("route -> execution starts", "route<", "execute<"),
    ("execution", "execute<", "execute>"),
    ("execution -> answer written", "execute>", "respond<"),
    ("answer written -> client has it", "respond>", "answered"),
]
#: What runs beside a request (not its own path): each one's time inside the request's window.
BESIDE = ("unload", "trim", "evict", "ahead", "read_ahead", "gc")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def analyse(rows: list[dict[str, Any]], events: list[list[Any]], main_thread: int) -> dict[str, Any]:
    """Per request, the stamps inside its window (client send to answer); per stage, the
    medians and p99s over misses and over hits."""
    events.sort(key=lambda e: e[0])
    times = [e[0] for e in events]
    import bisect

    per_kind: dict[str, dict[str, list[float]]] = {"miss": defaultdict(list), "hit": defaultdict(list)}
    beside: dict[str, dict[str, list[float]]] = {"miss": defaultdict(list), "hit": defaultdict(list)}
    functions: dict[str, dict[str, list[float]]] = {"miss": defaultdict(list), "hit": defaultdict(list)}
    session_cpu: list[float] = []
    session_thread_other: list[float] = []
    inline_first = 0
    misses = 0
    for row in rows:
        lo, hi = bisect.bisect_left(times, row["sent"]), bisect.bisect_right(times, row["answered"])
        window = events[lo:hi]
        stamps: list[tuple[int, str, int, int]] = [(row["sent"], "sent", 0, 0)]
        stamps += [(e[0], e[2], e[1], e[4]) for e in window]
        stamps.append((row["answered"], "answered", 0, 0))
        kind = "hit" if row["hit"] else "miss"
        stages = HIT_STAGES if row["hit"] else MISS_STAGES
        total = (row["answered"] - row["sent"]) / 1e3
        per_kind[kind]["total (client)"].append(total)
        for label, start, end in stages:
            t_start = next((t for t, ev, *_ in stamps if ev == start), None)
            if t_start is None:
                continue
            t_end = next((t for t, ev, *_ in stamps if ev == end and t >= t_start), None)
            if t_end is not None:
                per_kind[kind][label].append((t_end - t_start) / 1e3)
        opened_at: dict[tuple[str, int], int] = {}
        seen: set[str] = set()
        for t, ev, _, tid in stamps:
            if ev.endswith("<"):
                opened_at.setdefault((ev[:-1], tid), t)
            elif ev.endswith(">") and (ev[:-1], tid) in opened_at and ev[:-1] not in seen:
                seen.add(ev[:-1])
                functions[kind][ev[:-1]].append((t - opened_at[(ev[:-1], tid)]) / 1e3)
        if not row["hit"]:
            misses += 1
            opened = [(t, c, tid) for t, ev, c, tid in stamps if ev == "session<"]
            closed = [(t, c, tid) for t, ev, c, tid in stamps if ev == "session>"]
            if opened and closed:
                session_cpu.append((closed[0][1] - opened[0][1]) / 1e3)
                session_thread_other.append(((closed[0][0] - opened[0][0]) - (closed[0][1] - opened[0][1])) / 1e3)
            execute = [tid for _, ev, _, tid in stamps if ev == "execute<"]
            inline_first += bool(execute) and execute[0] == main_thread
        # what else ran inside the window
        open_at: dict[tuple[str, int], int] = {}
        spent: dict[str, float] = defaultdict(float)
        for t, ev, _, tid in stamps:
            base = ev.rstrip("<>")
            if base not in BESIDE:
                continue
            if ev.endswith("<"):
                open_at[(base, tid)] = t
            elif (base, tid) in open_at:
                spent[base] += (t - open_at.pop((base, tid))) / 1e3
        for (base, _tid), t in open_at.items():
            spent[base] += (row["answered"] - t) / 1e3
        for base in BESIDE:
            beside[kind][base].append(spent.get(base, 0.0))
    summary: dict[str, Any] = {"misses": misses, "hits": len(rows) - misses, "first_execution_inline": inline_first}
    for kind in ("miss", "hit"):
        summary[kind] = {
            label: {"p50": pct(values, 50), "p99": pct(values, 99), "mean": statistics.fmean(values), "n": len(values)}
            for label, values in per_kind[kind].items()
        }
        summary[kind + "_beside"] = {
            base: {"share": sum(1 for v in values if v > 0) / max(1, len(values)), "mean": statistics.fmean(values) if values else 0.0, "p99": pct(values, 99)}
            for base, values in beside[kind].items()
        }
    for kind in ("miss", "hit"):
        summary[kind + "_functions"] = {
            label: {"p50": pct(values, 50), "p99": pct(values, 99), "n": len(values)}
            for label, values in sorted(functions[kind].items())
        }
    summary["session_cpu_us"] = {"p50": pct(session_cpu, 50), "p99": pct(session_cpu, 99)}
    summary["session_off_cpu_us"] = {"p50": pct(session_thread_other, 50), "p99": pct(session_thread_other, 99)}
    return summary


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        return probe_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--resident", type=int, default=100)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    parser.add_argument("--no-floor", action="store_true", help="the server's timeline only")
    parser.add_argument("--fine", action="store_true", help="stamp the steps inside the stages too")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set in the server's environment (experiments)")
    parser.add_argument("--keep-events", type=Path, help="write the raw stamps and requests to this JSON file")
    args = parser.parse_args()

    from quiver.lifecycle.eviction import zipf_trace

    trace = zipf_trace(args.models, args.requests, args.zipf, args.seed)
    value_of = {name: int(name.split("_")[1]) for name in trace}
    with tempfile.TemporaryDirectory(prefix="quiver-mt-") as tmp_name:
        tmp = Path(tmp_name)
        from benchmarks.multi_model import model

        repo = tmp / "models"
        repo.mkdir()
        build(repo, args.models)
        per_model = 2 * MB + len(model(0.0)) * 2
        limit = per_model * args.resident + 16 * MB
        flags = ["--model-control-mode", "on_demand", "--model-memory-limit", str(limit)]
        out = tmp / "events.json"
        wrapper = tmp / "quiver-probe"
        wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m benchmarks.miss_timeline --probe {out}{' --fine' if args.fine else ''} \"$@\"\n")
        wrapper.chmod(0o755)
        server = QuiverServer(
            str(repo), flags, log=tmp / "server.log", executable=wrapper, ready_path=None, timeout=60.0,
            stop_timeout=60.0, cwd=ROOT, env=dict(e.split("=", 1) for e in args.env),
        )
        with server:
            endpoints = server.endpoints
            rows = replay_stamped(str(endpoints.http), f"http://{endpoints.metrics}/metrics", trace, value_of)
            pid = server.pid
        probed = json.loads(out.read_text())
        if args.keep_events:
            args.keep_events.write_text(json.dumps({"rows": rows, **probed}))
        main_thread = next((int(i) for i, n in probed["threads"].items() if n == "MainThread"), pid)
        summary = analyse(rows, probed["events"], main_thread)
        summary["server_session_options"] = probed["options"]
        if not args.no_floor:
            import multiprocessing

            with multiprocessing.get_context("spawn").Pool(1) as pool:
                floor = pool.apply(floor_timeline, (repo, trace, 105, probed["options"]))
            summary["floor"] = {
                key: {"p50": pct([r[key] for r in floor], 50), "p99": pct([r[key] for r in floor], 99)}
                for key in floor[0]
            }
    summary["command"] = common.command_line()
    summary["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "miss_timeline.json").write_text(json.dumps(summary, indent=2))
    text = report(summary)
    (args.output_dir / "miss_timeline.md").write_text(text)
    print(text)
    return 0


def report(summary: dict[str, Any]) -> str:
    rows = [
        "# Where a miss's time goes (benchmarks.miss_timeline)",
        "",
        f"- Command: `{summary['command']}`; {summary['date']}; {summary['misses']} misses, {summary['hits']} hits; "
        f"first execution inline on the event loop: {summary['first_execution_inline']} of {summary['misses']}.",
        f"- The server's session options: `{json.dumps(summary['server_session_options'])}`",
        "",
        "| miss stage | p50 us | p99 us | mean us |",
        "|---|---:|---:|---:|",
    ]
    for label, value in summary["miss"].items():
        rows.append(f"| {label} | {value['p50']:.0f} | {value['p99']:.0f} | {value['mean']:.0f} |")
    rows += [
        f"| session creation's CPU on its thread | {summary['session_cpu_us']['p50']:.0f} | {summary['session_cpu_us']['p99']:.0f} | |",
        f"| session creation's wall minus CPU (waiting for a core or the GIL) | {summary['session_off_cpu_us']['p50']:.0f} | {summary['session_off_cpu_us']['p99']:.0f} | |",
        "",
        "| hit stage | p50 us | p99 us | mean us |",
        "|---|---:|---:|---:|",
    ]
    for label, value in summary["hit"].items():
        rows.append(f"| {label} | {value['p50']:.0f} | {value['p99']:.0f} | {value['mean']:.0f} |")
    rows += ["", "| beside the request (share of requests it overlapped; mean, p99 us inside the window) | misses | hits |", "|---|---:|---:|"]
    for base in BESIDE:
        m, h = summary["miss_beside"][base], summary["hit_beside"][base]
        rows.append(f"| {base} | {m['share']:.2f}; {m['mean']:.0f}, {m['p99']:.0f} | {h['share']:.2f}; {h['mean']:.0f}, {h['p99']:.0f} |")
    rows += ["", "| function (its own time, first call inside the request) | misses p50 / p99 us (n) | hits p50 / p99 us (n) |", "|---|---:|---:|"]
    for label, m in summary["miss_functions"].items():
        h = summary["hit_functions"].get(label)
        hit = f"{h['p50']:.0f} / {h['p99']:.0f} ({h['n']})" if h else ""
        rows.append(f"| {label} | {m['p50']:.0f} / {m['p99']:.0f} ({m['n']}) | {hit} |")
    if "floor" in summary:
        rows += ["", "| floor (same trace, in-process, the server's options) | p50 us | p99 us |", "|---|---:|---:|"]
        for key, value in summary["floor"].items():
            rows.append(f"| {key} | {value['p50']:.0f} | {value['p99']:.0f} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
