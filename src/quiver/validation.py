"""A request checked against its model's configuration, with Triton's checks and messages
(inputs, datatypes, shapes, batch size, requested outputs), and an answer shaped as the request
asked (the requested outputs in its order, Triton's classification extension)."""

from __future__ import annotations

import numpy as np

from quiver import messages
from quiver.config import ModelConfig
from quiver.errors import InvalidArgumentError
from quiver.lifecycle import Model
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor


def validate_request(config: ModelConfig, request: InferenceRequest) -> None:
    """The request against the model's configuration, with Triton's checks and messages."""
    inputs = config.input_map
    batching = config.max_batch_size > 0
    batch_size = -1
    name = config.name
    for tensor in request.inputs:
        spec = inputs.get(tensor.name)
        if spec is None:
            raise InvalidArgumentError(messages.unexpected_input(tensor.name, name, list(inputs)))
        if tensor.datatype is not spec.datatype:
            raise InvalidArgumentError(
                messages.input_datatype(tensor.name, tensor.datatype.value, name, spec.datatype.value)
            )
        shape = tensor.shape
        dims = spec.dims
        if batching:
            if len(shape) != len(dims) + 1:
                raise _shape_error(tensor, spec.full_shape(config.max_batch_size), name, batching)
            if batch_size < 0:
                batch_size = shape[0]
                if batch_size < 1 or batch_size > config.max_batch_size:
                    raise InvalidArgumentError(messages.batch_size(config.max_batch_size, name, batch_size, tensor.name))
            elif shape[0] != batch_size:
                raise InvalidArgumentError(
                    f"inputs of one request must share the batch size: input '{tensor.name}' "
                    f"has {shape[0]}, another has {batch_size} (model '{name}')"
                )
            shape = shape[1:]
        elif len(shape) != len(dims):
            raise _shape_error(tensor, list(dims), name, batching)
        for got, want in zip(shape, dims, strict=True):
            if want != -1 and got != want:
                raise _shape_error(tensor, spec.full_shape(config.max_batch_size), name, batching)
    given = {t.name for t in request.inputs}
    if len(given) != len(request.inputs):
        seen: set[str] = set()
        for tensor in request.inputs:
            if tensor.name in seen:
                raise InvalidArgumentError(messages.input_twice(tensor.name))
            seen.add(tensor.name)
    if len(given) != len(inputs):
        missing = [t.name for t in config.inputs if t.name not in given and not t.optional]
        if missing:
            required = sum(1 for t in config.inputs if not t.optional)
            raise InvalidArgumentError(
                messages.missing_inputs(
                    required, len(inputs), [t.name for t in request.inputs], missing, name
                )
            )
    if request.outputs is not None:
        outputs = config.output_map
        asked: set[str] = set()
        for requested in request.outputs:
            if requested.name not in outputs:
                raise InvalidArgumentError(messages.unexpected_output(requested.name, name, list(outputs)))
            if requested.name in asked:
                raise InvalidArgumentError(messages.output_twice(requested.name))
            asked.add(requested.name)
            k = requested.parameters.get("classification")
            if k is not None and (type(k) is not int or k < 0):
                raise InvalidArgumentError(
                    f"output '{requested.name}': 'classification' must be a non-negative integer"
                )


def _shape_error(tensor: Tensor, expected: list[int], model: str, batching: bool) -> InvalidArgumentError:
    return InvalidArgumentError(messages.input_shape(tensor.name, model, expected, list(tensor.shape), batching))


def select_outputs(model: Model, request: InferenceRequest, response: InferenceResponse) -> list[Tensor]:
    """The requested outputs in the order asked for; classification applied where asked."""
    assert request.outputs is not None
    produced = {t.name: t for t in response.outputs}
    selected: list[Tensor] = []
    for requested in request.outputs:
        tensor = produced.get(requested.name)
        if tensor is None:
            continue  # the model did not produce it (Triton omits it too)
        k = requested.classification
        if k:
            tensor = classify(
                tensor, k, model.labels.get(tensor.name), model.config.max_batch_size > 0, model.name
            )
        selected.append(tensor)
    return selected


def classify(
    tensor: Tensor, k: int, labels: list[str] | None, batched: bool, model: str
) -> Tensor:
    """Triton's classification extension: top-k as ``"value:index[:label]"`` strings."""
    if tensor.datatype in (DataType.BYTES, DataType.BOOL):
        raise InvalidArgumentError(
            f"model '{model}': classification needs a numeric output, '{tensor.name}' is "
            f"{tensor.datatype.value}"
        )
    data = tensor.data
    rows = data.reshape(data.shape[0], -1) if batched and data.ndim > 0 else data.reshape(1, -1)
    if rows.shape[1] == 0:
        # the request's own inputs were empty: the client's mistake, not the server's
        raise InvalidArgumentError(
            f"model '{model}': output '{tensor.name}' is empty; nothing to classify"
        )
    k = min(k, rows.shape[1])
    values = rows.astype(np.float64, copy=False)
    order = np.argsort(-values, axis=1, kind="stable")[:, :k]
    out = np.empty((rows.shape[0], k), dtype=object)
    for r in range(rows.shape[0]):
        for c in range(k):
            index = int(order[r, c])
            text = f"{values[r, index]:f}:{index}"
            if labels is not None and index < len(labels) and labels[index]:
                text += f":{labels[index]}"  # no label, as in Triton, for an empty line
            out[r, c] = text.encode("utf-8")
    result = out if batched else out.reshape(k)
    return Tensor(tensor.name, DataType.BYTES, result.shape, result)
