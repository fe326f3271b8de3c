"""The batch helpers the framework backends share (backends/batch.py)."""

from __future__ import annotations

import numpy as np
import pytest

from quiver.backends.batch import concatenate, requested_names, reshaped, split_rows
from quiver.errors import InvalidArgumentError
from quiver.types import InferenceRequest, RequestedOutput


def _request(outputs: list[str] | None) -> InferenceRequest:
    wanted = None if outputs is None else [RequestedOutput(name) for name in outputs]
    return InferenceRequest(model_name="m", model_version="", inputs=[], outputs=wanted)


def test_requested_names_is_the_union_in_configuration_order() -> None:
    requests = [_request(["C"]), _request(["A"])]
    assert requested_names(requests, ["A", "B", "C"]) == ["A", "C"]


def test_a_request_without_outputs_asks_for_all() -> None:
    assert requested_names([_request(["C"]), _request(None)], ["A", "B", "C"]) == ["A", "B", "C"]


def test_state_outputs_are_always_computed_once() -> None:
    outputs = ["OUT", "STATE"]
    assert requested_names([_request(["OUT"])], outputs, ["STATE", "HIDDEN"]) == [
        "OUT",
        "STATE",
        "HIDDEN",
    ]
    assert requested_names([_request(None)], outputs, ["HIDDEN"]) == ["OUT", "STATE", "HIDDEN"]


def test_reshaped_keeps_the_batch_dimension_only_when_batching() -> None:
    array = np.arange(12).reshape(2, 6)
    assert reshaped(array, None, True) is array
    assert reshaped(array, [2, 3], True).shape == (2, 2, 3)
    assert reshaped(array.reshape(-1), [3, 4], False).shape == (3, 4)


def test_concatenate_joins_on_dim_zero_and_counts_rows() -> None:
    feeds = [{"X": np.zeros((1, 4))}, {"X": np.ones((3, 4))}]
    feed, sizes = concatenate("m", feeds)
    assert feed["X"].shape == (4, 4) and sizes == [1, 3]
    parts = list(split_rows([feed["X"]], sizes))
    assert [p[0].shape for p in parts] == [(1, 4), (3, 4)]
    assert parts[1][0].sum() == 12


def test_concatenate_names_the_model_when_shapes_do_not_line_up() -> None:
    feeds = [{"X": np.zeros((1, 4))}, {"X": np.zeros((1, 5))}]
    with pytest.raises(InvalidArgumentError, match="model 'm': requests cannot be batched together"):
        concatenate("m", feeds)
