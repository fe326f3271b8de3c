"""What a TensorFlow model declares, and the configuration against it: reading GraphDef and
SavedModel files, a SavedModel's signature tensors, auto-complete from them (Triton's
batching hint), and the load-time checks of configured tensors against the graph or the
signature; plus TensorFlow datatypes as Triton's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's C++ start-up chatter, before import

import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2
from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import (
    format_exception,
)
from quiver.backends.tensorflow_settings import TFSettings
from quiver.config import ModelConfig
from quiver.errors import ConfigError, InvalidArgumentError
from quiver.types import DataType

logger = logging.getLogger(
    "quiver.backends.tensorflow"
)  # the backend's logger, as before the split

GRAPHDEF = "tensorflow_graphdef"
SAVEDMODEL = "tensorflow_savedmodel"
#: Triton's ``default-max-batch-size`` when auto-complete finds a model that batches.
DEFAULT_MAX_BATCH_SIZE = 4

_TF_TYPES: dict[int, DataType] = {
    types_pb2.DT_BOOL: DataType.BOOL,
    types_pb2.DT_UINT8: DataType.UINT8,
    types_pb2.DT_UINT16: DataType.UINT16,
    types_pb2.DT_UINT32: DataType.UINT32,
    types_pb2.DT_UINT64: DataType.UINT64,
    types_pb2.DT_INT8: DataType.INT8,
    types_pb2.DT_INT16: DataType.INT16,
    types_pb2.DT_INT32: DataType.INT32,
    types_pb2.DT_INT64: DataType.INT64,
    types_pb2.DT_HALF: DataType.FP16,
    types_pb2.DT_BFLOAT16: DataType.BF16,
    types_pb2.DT_FLOAT: DataType.FP32,
    types_pb2.DT_DOUBLE: DataType.FP64,
    types_pb2.DT_STRING: DataType.BYTES,
}

_INIT_OP, _TRAIN_OP = "__saved_model_init_op", "__saved_model_train_op"


def _datatype(dtype: int) -> DataType | None:
    return _TF_TYPES.get(int(dtype))


def _type_name(dtype: int) -> str:
    found = _datatype(dtype)
    return found.config_name if found else types_pb2.DataType.Name(int(dtype))


# --- reading models -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One model tensor: the name in the configuration, the name in the graph, and what the
    model says of its type and shape (``None`` where it does not know)."""

    name: str
    tensor: str
    dtype: int | None
    shape: tuple[int, ...] | None  # -1 for unknown dimensions; None for unknown rank


def _shape_of(proto: Any) -> tuple[int, ...] | None:
    if proto.unknown_rank:
        return None
    return tuple(int(d.size) if d.size >= 0 else -1 for d in proto.dim)


def read_graphdef(path: Path, model: str) -> Any:
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise InvalidArgumentError(
            f"model '{model}': {path} is a folder; a tensorflow_graphdef model is one GraphDef "
            "file (a SavedModel folder needs platform 'tensorflow_savedmodel')"
        ) from None
    except OSError as exc:
        raise InvalidArgumentError(f"model '{model}': cannot read {path}: {exc}") from None
    graph_def = tf.compat.v1.GraphDef()
    try:
        graph_def.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"model '{model}': {path.name} is not a TensorFlow GraphDef: {format_exception(exc)}"
        ) from None
    if not graph_def.node:
        raise InvalidArgumentError(
            f"model '{model}': {path.name} has an empty network (not a TensorFlow GraphDef?)"
        )
    return graph_def


def read_saved_model(path: Path, model: str, settings: TFSettings) -> tuple[str, Any]:
    """The tag and the chosen ``SignatureDef`` of the SavedModel at ``path``, read from its
    ``saved_model.pb`` without loading its variables."""
    pb_path = path / "saved_model.pb"
    if not path.is_dir():
        raise InvalidArgumentError(
            f"model '{model}': {path} is not a SavedModel folder (a frozen GraphDef file needs "
            "platform 'tensorflow_graphdef')"
        )
    try:
        saved = saved_model_pb2.SavedModel()
        saved.ParseFromString(pb_path.read_bytes())
    except OSError as exc:
        raise InvalidArgumentError(
            f"model '{model}': {path.name} is not a SavedModel: cannot read saved_model.pb: {exc}"
        ) from None
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"model '{model}': {path.name}/saved_model.pb is not a SavedModel: "
            f"{format_exception(exc)}"
        ) from None
    tag = settings.graph_tag or "serve"
    metas = [m for m in saved.meta_graphs if tag in m.meta_info_def.tags]
    if not metas:
        tags = sorted({t for m in saved.meta_graphs for t in m.meta_info_def.tags})
        raise InvalidArgumentError(
            f"model '{model}': unable to load the SavedModel, expected '{tag}' tag (it has: "
            f"{', '.join(tags) or 'none'})"
        )
    meta: meta_graph_pb2.MetaGraphDef = metas[0]
    return tag, _signature(meta, model, settings.signature_def)


def _signature(meta: Any, model: str, wanted: str) -> Any:
    key = wanted or "serving_default"
    signatures = meta.signature_def
    if key in signatures:
        return signatures[key]
    usable = [k for k in signatures if k not in (_INIT_OP, _TRAIN_OP)]
    if not wanted and usable:
        logger.warning(
            "model '%s': no 'serving_default' signature; using signature '%s'", model, usable[0]
        )
        return signatures[usable[0]]
    raise InvalidArgumentError(
        f"model '{model}': unable to load the SavedModel, expected '{key}' signature (it has: "
        f"{', '.join(usable) or 'none'})"
    )


def signature_tensors(signature: Any) -> tuple[list[TensorInfo], list[TensorInfo]]:
    def infos(entries: Any) -> list[TensorInfo]:
        return [
            TensorInfo(key, info.name, int(info.dtype), _shape_of(info.tensor_shape))
            for key, info in sorted(entries.items())
        ]

    return infos(signature.inputs), infos(signature.outputs)


# --- auto-complete ------------------------------------------------------------------------


def _batches(tensors: Iterable[TensorInfo]) -> bool:
    """Every tensor has a variable first dimension (the signature can batch)."""
    items = list(tensors)
    return bool(items) and all(
        t.shape is not None and len(t.shape) > 0 and t.shape[0] == -1 for t in items
    )


def _batch_hint(
    config: pb.ModelConfig, inputs: list[TensorInfo], outputs: list[TensorInfo]
) -> bool:
    """Triton's rule: with no tensors configured, the signature decides; else configured
    tensors whose dims are one shorter than the model's rank say "batching"."""
    if not config.input and not config.output:
        return True
    hint: bool | None = None
    weak = False
    for entries, tensors in ((config.input, inputs), (config.output, outputs)):
        by_name = {t.name: t for t in tensors}
        for entry in entries:
            tensor = by_name.get(entry.name)
            if tensor is None or tensor.shape is None or not tensor.shape:
                continue
            dims = list(entry.reshape.shape) if entry.HasField("reshape") else list(entry.dims)
            if not dims:
                weak = True
                continue
            says = len(dims) == len(tensor.shape) - 1
            if hint is not None and hint != says:
                raise ConfigError(
                    f"unable to autofill for '{config.name}', model tensor configurations are "
                    "contradicting each other in terms of whether batching is supported"
                )
            hint = says
    return hint if hint is not None else weak


def auto_complete_saved_model(config: pb.ModelConfig, path: Path, settings: TFSettings) -> None:
    _, signature = read_saved_model(path, config.name, settings)
    inputs, outputs = signature_tensors(signature)
    supports = _batches(inputs + outputs)
    if not supports and config.max_batch_size > 0:
        raise ConfigError(
            f"unable to autofill for '{config.name}', configuration specified max-batch "
            f"{config.max_batch_size} but model signature does not support batching"
        )
    if config.max_batch_size == 0 and supports and _batch_hint(config, inputs, outputs):
        config.max_batch_size = DEFAULT_MAX_BATCH_SIZE
        logger.info(
            "model '%s': auto-completed max_batch_size to %d", config.name, DEFAULT_MAX_BATCH_SIZE
        )
    if (
        config.max_batch_size > 1
        and not config.HasField("dynamic_batching")
        and not config.HasField("sequence_batching")
    ):
        config.dynamic_batching.SetInParent()
    skip = 1 if config.max_batch_size > 0 else 0
    injected = {c.name for c in config.sequence_batching.control_input}
    _complete(config, config.input, [t for t in inputs if t.name not in injected], skip)
    _complete(config, config.output, outputs, skip)


def _complete(config: pb.ModelConfig, entries: Any, tensors: list[TensorInfo], skip: int) -> None:
    def fill(entry: Any, tensor: TensorInfo) -> None:
        if entry.data_type == pb.TYPE_INVALID and tensor.dtype is not None:
            datatype = _datatype(tensor.dtype)
            if datatype is None:
                raise ConfigError(
                    f"model '{config.name}': tensor '{tensor.name}' has type "
                    f"{_type_name(tensor.dtype)}, which Triton datatypes cannot carry"
                )
            entry.data_type = pb.DataType.Value(datatype.config_name)
        if len(entry.dims) == 0 and not entry.HasField("reshape"):
            dims = list(tensor.shape[skip:]) if tensor.shape is not None else [-1]
            entry.dims.extend(dims)
            if not dims:
                entry.reshape.SetInParent()

    if len(entries) == 0:
        for tensor in tensors:
            fill(entries.add(name=tensor.name), tensor)
        return
    by_name = {t.name: t for t in tensors}
    for entry in entries:
        found = by_name.get(entry.name)
        if found is not None:
            fill(entry, found)


# --- checks at load -----------------------------------------------------------------------


def _listing(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(sorted(names)[:limit])
    more = len(names) - limit
    return f"{shown} and {more} more" if more > 0 else shown or "none"


def _check_tensor(
    config: ModelConfig,
    kind: str,
    name: str,
    expected: DataType,
    dims: tuple[int, ...],
    tensor: TensorInfo,
) -> bool:
    """Datatype and shape of one configured tensor against the model; returns whether the
    model fixes its batch dimension to 1 (run batches row by row)."""
    if tensor.dtype is not None:
        actual = _datatype(tensor.dtype)
        if actual is not expected:
            raise ConfigError(
                f"{config.source}: unable to load model '{config.name}', configuration expects "
                f"datatype {expected.config_name} for {kind} '{name}', model provides "
                f"{_type_name(tensor.dtype)}"
            )
    shape = tensor.shape
    if shape is None:
        return False
    batching = config.max_batch_size > 0
    want = len(dims) + (1 if batching else 0)
    fixed_batch_of_one = False
    if len(shape) != want:
        raise ConfigError(
            f"{config.source}: unable to load model '{config.name}', {kind} '{name}' has shape "
            f"{list(shape)} in the model but the configuration gives dims {list(dims)}"
            + (
                f" with max_batch_size {config.max_batch_size} (a batch dimension first)"
                if batching
                else ""
            )
        )
    rest = shape
    if batching:
        if shape[0] == 1:
            fixed_batch_of_one = True
        elif shape[0] != -1:
            raise ConfigError(
                f"{config.source}: unable to load model '{config.name}', {kind} '{name}' has "
                f"a fixed batch of {shape[0]} ({list(shape)}) but max_batch_size is "
                f"{config.max_batch_size}: set max_batch_size: 0 and dims {list(shape)}"
            )
        rest = shape[1:]
    for model_dim, config_dim in zip(rest, dims, strict=True):
        if model_dim != -1 and config_dim != -1 and model_dim != config_dim:
            raise ConfigError(
                f"{config.source}: unable to load model '{config.name}', {kind} '{name}' has "
                f"shape {list(shape)} in the model but the configuration gives dims {list(dims)}"
            )
    return fixed_batch_of_one


def _graph_tensors(graph: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Placeholders (possible inputs) and every other node (possible outputs), by name."""
    inputs: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    for op in graph.get_operations():
        (inputs if op.type == "Placeholder" else outputs)[op.name] = op
    return inputs, outputs


def _graph_info(name: str, ops: dict[str, Any]) -> TensorInfo | None:
    node, _, index = name.partition(":")
    op = ops.get(node)
    if op is None:
        return None
    position = int(index) if index.isdigit() else 0
    if position >= len(op.outputs):
        return None
    tensor = op.outputs[position]
    shape = tensor.shape
    dims = (
        None if shape.rank is None else tuple(-1 if d is None else int(d) for d in shape.as_list())
    )
    return TensorInfo(name, tensor.name, int(tensor.dtype.as_datatype_enum), dims)
