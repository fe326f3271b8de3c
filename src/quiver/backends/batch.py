"""What the framework backends share to run several requests as one batch.

ONNX Runtime, TorchScript and TensorFlow instances all run a scheduler's batch the same way:
compute the union of the outputs the requests ask for, reshape each tensor between its wire
shape and the model's (``reshape`` in the configuration), concatenate the requests' inputs on
dim 0, run once, and cut the outputs back into each request's rows. The framework-specific
parts (feeding, running, converting results) stay in each backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from quiver.errors import InvalidArgumentError
from quiver.types import InferenceRequest


def requested_names(
    requests: Iterable[InferenceRequest], outputs: list[str], state_outputs: Sequence[str] = ()
) -> list[str]:
    """The outputs to compute for a batch: those any request asks for, in configuration order.

    A request that names no outputs asks for all of them. A sequence model's state outputs are
    always computed (the next step of the sequence reads them), asked for or not.
    """
    if not state_outputs and isinstance(requests, list) and len(requests) == 1:
        asked = requests[0].outputs  # one request asking for one output: the common case
        if asked is None:
            return outputs
        if len(asked) == 1:
            name = asked[0].name
            return [name] if name in outputs else []
    wanted: set[str] = set()
    for request in requests:
        if request.outputs is None:
            if not state_outputs:
                return outputs
            wanted.update(outputs)
            break
        wanted.update(o.name for o in request.outputs)
    names = [name for name in outputs if name in wanted]
    names += [name for name in state_outputs if name not in names]
    return names


def reshaped(array: Any, dims: Sequence[int] | None, batching: bool) -> Any:
    """``array`` with the shape ``dims`` (a configuration's ``reshape``), its batch dim kept."""
    if dims is None:
        return array
    lead = array.shape[:1] if batching else ()
    return array.reshape(lead + tuple(dims))


def not_batchable(model: str, exc: Exception) -> InvalidArgumentError:
    """The error for requests whose tensors cannot be concatenated into one batch."""
    return InvalidArgumentError(f"model '{model}': requests cannot be batched together: {exc}")


def concatenate(model: str, feeds: list[dict[str, Any]]) -> tuple[dict[str, Any], list[int]]:
    """The requests' feeds joined on dim 0, and the rows each request brought.

    Raises :class:`InvalidArgumentError` when the requests' shapes or types do not line up.
    """
    sizes = [next(iter(f.values())).shape[0] if f else 1 for f in feeds]
    try:
        return {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}, sizes
    except ValueError as exc:
        raise not_batchable(model, exc) from None


def split_rows(arrays: Sequence[Any], sizes: Iterable[int]) -> Iterator[list[Any]]:
    """Each request's rows of a batch's outputs, in the order of ``sizes``."""
    offset = 0
    for size in sizes:
        yield [a[offset : offset + size] for a in arrays]
        offset += size
