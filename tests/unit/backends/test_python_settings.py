"""The python backend's --backend-config keys: values checked, errors naming the key."""

from __future__ import annotations

import pytest

from quiver.backends.python_settings import PythonSettings, parse_python_settings
from quiver.errors import InvalidArgumentError


def test_defaults_and_values() -> None:
    assert parse_python_settings({}) == PythonSettings()
    assert parse_python_settings({}).spin_microseconds == 0
    settings = parse_python_settings({"spin-microseconds": "100", "stub-timeout-seconds": "5", "in-process": "true"})
    assert (settings.spin_microseconds, settings.stub_timeout_seconds, settings.in_process) == (100, 5.0, True)
    assert parse_python_settings({"spin-microseconds": " 250 "}).spin_microseconds == 250
    assert parse_python_settings({}).answer_spin_microseconds == 300
    assert parse_python_settings({"answer-spin-microseconds": "0"}).answer_spin_microseconds == 0
    assert parse_python_settings({}).answer_spin_pressure == 10.0
    assert parse_python_settings({"answer-spin-pressure": "100"}).answer_spin_pressure == 100.0
    assert parse_python_settings({}).worker_queue_depth == 8
    assert parse_python_settings({"worker-queue-depth": "1"}).worker_queue_depth == 1


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("spin-microseconds", "-1"),
        ("spin-microseconds", "fast"),
        ("spin-microseconds", "2000000"),
        ("answer-spin-microseconds", "-5"),
        ("answer-spin-microseconds", "1e3"),
        ("answer-spin-pressure", "101"),
        ("answer-spin-pressure", "lots"),
        ("stub-timeout-seconds", "0"),
        ("shm-default-byte-size", "10"),
        ("shm-region-prefix-name", "a/b"),
        ("in-process", "maybe"),
        ("worker-queue-depth", "0"),
        ("worker-queue-depth", "two"),
        ("worker-queue-depth", "5000"),
    ],
)
def test_bad_values_name_their_key(key: str, value: str) -> None:
    with pytest.raises(InvalidArgumentError, match=key):
        parse_python_settings({key: value})
