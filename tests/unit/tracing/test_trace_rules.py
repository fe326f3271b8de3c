"""The trace flags and settings rules, as Triton's parser and TraceManager apply them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from quiver.errors import InvalidArgumentError, UnsupportedError
from quiver.tracing.config import (
    LEVEL_OFF,
    LEVEL_TENSORS,
    LEVEL_TIMESTAMPS,
    TraceConfigError,
    from_flags,
)
from quiver.tracing.manager import TraceManager
from quiver.tracing.trace import tensor_json
from quiver.types import DataType, Tensor


def test_flags_merge_as_tritonserver_merges_them() -> None:
    config = from_flags(
        ["triton,file=t.json", "level=TIMESTAMPS", "rate=5"], trace_level=["TENSORS"], trace_rate="9", environ={}
    )
    assert config.level == LEVEL_TIMESTAMPS | LEVEL_TENSORS
    assert config.rate == 5  # --trace-config wins over --trace-rate
    assert config.file == "t.json" and config.mode == "triton"
    assert any("--trace-rate" in w for w in config.warnings)
    assert from_flags(["level=TIMESTAMPS", "level=OFF"], environ={}).level == LEVEL_OFF
    assert from_flags(["level=max"], environ={}).level == LEVEL_TIMESTAMPS
    assert from_flags(environ={}).rate == 1000 and from_flags(environ={}).count == -1


def test_opentelemetry_options_and_their_defaults() -> None:
    config = from_flags(
        ["mode=opentelemetry", "opentelemetry,url=collector:4318/v1/traces", "opentelemetry,resource=a=b",
         "triton,file=ignored.json", "opentelemetry,bsp_max_queue_size=1000"],
        environ={"OTEL_BSP_SCHEDULE_DELAY": "250"},
    )  # fmt: skip
    assert config.mode == "opentelemetry" and config.file == ""
    assert dict(config.options) == {
        "url": "collector:4318/v1/traces",
        "resource": "a=b",
        "bsp_max_queue_size": "1000",
        "bsp_schedule_delay": "250",
        "bsp_max_export_batch_size": "512",
    }
    with pytest.raises(TraceConfigError, match="bsp_max_export_batch_size must not be larger"):
        from_flags(["mode=opentelemetry", "opentelemetry,bsp_max_queue_size=10"], environ={})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["level=LOUD"], "invalid value for trace level option: LOUD"),
        (["mode=zipkin"], "invalid value for trace mode option: zipkin"),
        ([",rate=1"], "No trace mode specified"),
        (["rate"], "--trace-config option format is '<trace mode>,<setting>=<value>'. Got rate"),
        (["count=-2"], 'Bad option: "--trace-config count"'),
        (["triton,log-frequency=x"], 'Bad option: "--trace-config triton,log-frequency"'),
    ],
)
def test_bad_flags_say_what_is_wrong(flags: list[str], message: str) -> None:
    with pytest.raises(TraceConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_flags(flags, environ={})


def _manager(tmp_path: Path, *flags: str) -> TraceManager:
    return TraceManager(from_flags([f"triton,file={tmp_path / 't.json'}", *flags], environ={}))


def test_model_settings_follow_the_global_values_they_never_set(tmp_path: Path) -> None:
    manager = _manager(tmp_path, "level=TIMESTAMPS", "rate=1")
    try:
        manager.update("m", {"trace_rate": "12"})
        manager.update("", {"trace_count": "7", "trace_level": ["OFF"]})
        assert manager.settings_json("m")["trace_count"] == "7"
        assert manager.settings_json("m")["trace_rate"] == "12"
        assert manager.settings_json("m")["trace_level"] == ["OFF"]
        # Clearing every value the model set makes it use the global setting again.
        manager.update("m", {"trace_rate": None})
        assert manager.setting("m") is manager.setting("")
        # Clearing a global value restores the start value.
        assert manager.update("", {"trace_count": None})["trace_count"] == "-1"
    finally:
        manager.close()


def test_updates_are_checked(tmp_path: Path) -> None:
    manager = TraceManager(from_flags(["level=OFF"], environ={}))  # no trace file
    try:
        with pytest.raises(InvalidArgumentError, match="Attempting to set invalid trace setting :trace file name is not given"):
            manager.update("", {"trace_level": ["TIMESTAMPS"]})
        with pytest.raises(UnsupportedError):
            manager.update("", {"trace_file": "x.json"})
        with pytest.raises(InvalidArgumentError, match="expect only 1 value for 'trace_rate'"):
            manager.update("", {"trace_rate": ["1", "2"]})
        with pytest.raises(InvalidArgumentError, match=r"value is out of range \[ -1, 2147483647 \]"):
            manager.update("", {"trace_count": "-5"})
        assert manager.update("", {"trace_level": ["BOGUS"]})["trace_level"] == ["OFF"]  # ignored, as Triton
    finally:
        manager.close()


def test_sampling_by_rate_and_count(tmp_path: Path) -> None:
    manager = _manager(tmp_path, "level=TIMESTAMPS", "rate=3", "count=2")
    try:
        sampled = [manager.sample("m") is not None for _ in range(9)]
        assert sampled == [False, False, True, False, False, True, False, False, False]
        assert manager.settings_json()["trace_count"] == "0"
        assert manager.sample("m") is None
    finally:
        manager.close()


def test_count_reached_writes_an_indexed_file(tmp_path: Path) -> None:
    manager = _manager(tmp_path, "level=TIMESTAMPS", "rate=1", "count=2")
    traces = [manager.sample("m") for _ in range(2)]
    for trace in traces:
        assert trace is not None
        trace.start("m", "", "", 1)
        trace.capture("REQUEST_END", 2)
        trace.release()
    manager.close()
    assert not (tmp_path / "t.json").exists()
    entries = json.loads((tmp_path / "t.json.0").read_text())
    assert [e["model_name"] for e in entries if "model_name" in e] == ["m", "m"]


def test_tensor_entries_as_triton_writes_them() -> None:
    strings = Tensor("S", DataType.BYTES, (2,), np.array([b"a", b"bc"], dtype=object))
    assert tensor_json(strings) == {"name": "S", "data": '"a","bc"', "shape": "2", "dtype": "BYTES"}
    flags = Tensor("B", DataType.BOOL, (1, 2), np.array([[True, False]]))
    assert tensor_json(flags)["data"] == "1,0"
    halves = Tensor("H", DataType.FP16, (1,), np.array([1.0], dtype=np.float16))
    assert tensor_json(halves)["data"] == ""
    floats = Tensor("F", DataType.FP32, (2,), np.array([0.1, 2.0], dtype=np.float32))
    assert tensor_json(floats)["data"] == "0.1,2"
