"""Model warmup: Triton's ``model_warmup`` samples, run on every instance before READY.

Each ``model_warmup`` entry of config.pbtxt is a sample: a ``name``, a ``batch_size``, the
``inputs`` (name -> ``data_type``, ``dims`` and one of ``zero_data``, ``random_data`` or
``input_data_file``) and a ``count`` (runs, default 1). As Triton does, a sample with
``batch_size`` N on a model that batches is N requests of one row each, executed together
(one execution of N rows); on a model that does not batch (``max_batch_size: 0``) the inputs
have no batch dimension and ``batch_size`` must be 0 or 1. ``batch_size: 0`` means no batch
dimension: one request whose inputs have exactly ``dims``.

``input_data_file`` is relative to the model's ``warmup/`` folder, as in Triton, and holds
the tensor's raw bytes in row-major order (BYTES: Triton's elements, each a 4-byte
little-endian length then its bytes). A numeric file may be longer than the tensor (Triton
reads the bytes it needs), never shorter. ``random_data`` on BYTES gives empty strings, as
Triton's does.

Warmup runs on the load thread, after the instances exist and before the version is READY,
straight on each instance (never through the scheduler), so it counts in no statistics. Any
problem, in the configuration or in the model's answers, fails the version's load with a
message naming the model, the sample and (for configuration errors) the input.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import ModelInstance, format_exception
from quiver.config import ModelConfig
from quiver.errors import InternalError, InvalidArgumentError, QuiverError, error_for_code
from quiver.lifecycle.clock import SYSTEM_CLOCK, Clock, seconds
from quiver.protocol.bytes_codec import deserialize_bytes
from quiver.types import DataType, InferenceRequest, Tensor

logger = logging.getLogger(__name__)

#: Triton's folder, inside the model's folder, for ``input_data_file``.
WARMUP_FOLDER = "warmup"


@dataclass(frozen=True, slots=True)
class WarmupSample:
    """One ``model_warmup`` entry, ready to run: the requests of one execution, and how often."""

    name: str
    requests: list[InferenceRequest]
    count: int


class _SampleError(InvalidArgumentError):
    pass


def build_warmup_samples(config: ModelConfig, model_dir: Path, *, seed: int | None = None) -> list[WarmupSample]:
    """Validate the configuration's ``model_warmup`` and build its requests.

    Raises :class:`InvalidArgumentError` naming the model, the sample and the input.
    """
    if not config.proto.model_warmup:
        return []  # seeding a generator from the OS costs more than the rest of a small load
    rng = np.random.default_rng(seed)
    samples: list[WarmupSample] = []
    for index, warmup in enumerate(config.proto.model_warmup):
        label = warmup.name or f"#{index}"
        samples.append(_build_sample(config, model_dir, warmup, label, rng))
    return samples


def _fail(config: ModelConfig, sample: str, message: str) -> _SampleError:
    return _SampleError(f"model '{config.name}': warmup sample '{sample}': {message}")


def _build_sample(
    config: ModelConfig, model_dir: Path, warmup: Any, label: str, rng: np.random.Generator
) -> WarmupSample:
    batching = config.max_batch_size > 0
    batch_size = int(warmup.batch_size)
    if batching and batch_size > config.max_batch_size:
        raise _fail(
            config, label, f"batch_size {batch_size} is larger than the model's max_batch_size {config.max_batch_size}"
        )
    if not batching and batch_size > 1:
        raise _fail(
            config, label, f"batch_size {batch_size} needs a model that batches; this one has max_batch_size 0"
        )
    if not warmup.inputs:
        raise _fail(config, label, "has no inputs")
    # One request per row when the model batches (Triton's way), else a single request.
    rows = batch_size if batching and batch_size > 0 else 1
    lead: tuple[int, ...] = (1,) if batching and batch_size > 0 else ()
    tensors: list[Tensor] = []
    for name in sorted(warmup.inputs):
        spec = warmup.inputs[name]
        tensors.append(_input_tensor(config, model_dir, label, name, spec, lead, rng))
    given = {t.name for t in tensors}
    missing = [i.name for i in config.inputs if not i.optional and i.name not in given]
    if missing:
        raise _fail(config, label, f"gives no data for input(s) {', '.join(missing)}, which the model requires")
    requests = [
        InferenceRequest(config.name, "", list(tensors), id=f"warmup:{label}:{row}") for row in range(rows)
    ]
    count = int(warmup.count) if warmup.count > 0 else 1
    return WarmupSample(label, requests, count)


def _input_tensor(
    config: ModelConfig,
    model_dir: Path,
    label: str,
    name: str,
    spec: Any,
    lead: tuple[int, ...],
    rng: np.random.Generator,
) -> Tensor:
    where = f"input '{name}'"
    declared = config.input_map.get(name)
    if declared is None and name in _sequence_inputs(config):
        # A sequence model's control or state input: Triton lets warmup give it as is.
        return _control_tensor(config, model_dir, label, name, spec, rng)
    if declared is None:
        known = ", ".join(i.name for i in config.inputs) or "none"
        raise _fail(config, label, f"{where} is not an input of the model (its inputs: {known})")
    try:
        datatype = DataType.from_config(pb.DataType.Name(spec.data_type))
    except (KeyError, ValueError):
        raise _fail(config, label, f"{where} has no valid data_type") from None
    if datatype is not declared.datatype:
        raise _fail(
            config,
            label,
            f"{where} is {datatype.config_name} in the warmup sample but "
            f"{declared.datatype.config_name} in the model configuration",
        )
    dims = tuple(int(d) for d in spec.dims)
    if any(d < 0 for d in dims):
        raise _fail(config, label, f"{where}: dims {list(dims)} must all be given (no -1)")
    if len(dims) != len(declared.dims) or any(c not in (-1, d) for c, d in zip(declared.dims, dims, strict=False)):
        raise _fail(
            config, label, f"{where}: dims {list(dims)} do not match the configuration's {list(declared.dims)}"
        )
    shape = lead + dims
    count = int(np.prod(shape, dtype=np.int64))
    kind = spec.WhichOneof("input_data_type")
    if kind == "zero_data" or (kind == "random_data" and datatype is DataType.BYTES):
        data = _zeros(datatype, count)
    elif kind == "random_data":
        data = _random(datatype, count, rng)
    elif kind == "input_data_file":
        data = _from_file(config, model_dir, label, name, spec.input_data_file, datatype, count)
    else:
        raise _fail(config, label, f"{where} sets none of zero_data, random_data, input_data_file")
    return Tensor(name, datatype, shape, data.reshape(shape))


def _sequence_inputs(config: ModelConfig) -> set[str]:
    batching = config.proto.sequence_batching
    names = {c.name for c in batching.control_input}
    names.update(state.input_name for state in batching.state)
    return names


def _control_tensor(
    config: ModelConfig, model_dir: Path, label: str, name: str, spec: Any, rng: np.random.Generator
) -> Tensor:
    where = f"input '{name}'"
    try:
        datatype = DataType.from_config(pb.DataType.Name(spec.data_type))
    except (KeyError, ValueError):
        raise _fail(config, label, f"{where} has no valid data_type") from None
    shape = tuple(int(d) for d in spec.dims)
    if any(d < 0 for d in shape):
        raise _fail(config, label, f"{where}: dims {list(shape)} must all be given (no -1)")
    if config.max_batch_size > 0:
        shape = (1, *shape)
    count = int(np.prod(shape, dtype=np.int64))
    kind = spec.WhichOneof("input_data_type")
    if kind == "input_data_file":
        data = _from_file(config, model_dir, label, name, spec.input_data_file, datatype, count)
    elif kind == "random_data" and datatype is not DataType.BYTES:
        data = _random(datatype, count, rng)
    else:
        data = _zeros(datatype, count)
    return Tensor(name, datatype, shape, data.reshape(shape))


def _zeros(datatype: DataType, count: int) -> np.ndarray[Any, Any]:
    if datatype is DataType.BYTES:
        data = np.empty(count, dtype=object)
        data[:] = b""
        return data
    return np.zeros(count, dtype=datatype.numpy_dtype)


def _random(datatype: DataType, count: int, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    dtype = datatype.numpy_dtype
    if datatype is DataType.BOOL:
        return rng.integers(0, 2, count).astype(np.bool_)
    if dtype.kind == "f":  # uniform [0, 1): random bytes would make NaNs and infinities
        return rng.random(count, dtype=np.float64).astype(dtype)
    return np.frombuffer(rng.bytes(count * dtype.itemsize), dtype=dtype).copy()


def _from_file(
    config: ModelConfig,
    model_dir: Path,
    label: str,
    name: str,
    filename: str,
    datatype: DataType,
    count: int,
) -> np.ndarray[Any, Any]:
    where = f"input '{name}'"
    folder = (model_dir / WARMUP_FOLDER).resolve()
    path = (folder / filename).resolve()
    if not filename or not path.is_relative_to(folder):
        raise _fail(config, label, f"{where}: input_data_file '{filename}' must name a file inside {folder}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise _fail(config, label, f"{where}: cannot read input_data_file {path}: {reason}") from None
    if datatype is DataType.BYTES:
        try:
            return deserialize_bytes(raw, count, name)
        except InvalidArgumentError as exc:
            raise _fail(
                config, label, f"input_data_file {path} does not hold {count} BYTES element(s): {exc}"
            ) from None
    need = count * datatype.itemsize
    if len(raw) < need:
        raise _fail(
            config,
            label,
            f"{where}: input_data_file {path} has {len(raw)} bytes, but {count} "
            f"{datatype.value} element(s) need {need}",
        )
    return np.frombuffer(raw[:need], dtype=datatype.numpy_dtype).copy()


def run_warmup(
    config: ModelConfig,
    version: int,
    instances: list[ModelInstance],
    samples: list[WarmupSample],
    *,
    clock: Clock = SYSTEM_CLOCK,
) -> None:
    """Run every sample ``count`` times on every instance; raises on the first failure.

    Called on a load thread (no running event loop): each instance's runs happen on a private
    event loop, which ThreadedInstance needs for ``run_in_executor``.
    """
    if not samples:
        return
    started = seconds(clock)
    for instance in instances:
        for sample in samples:
            begun = seconds(clock)
            asyncio.run(_run_sample(config, version, instance, sample))
            logger.debug(
                "model '%s' version %d instance %s: warmup sample '%s' ran %d time(s) in %.3f s",
                config.name, version, instance.name, sample.name, sample.count, seconds(clock) - begun,
            )
    runs = sum(s.count for s in samples) * len(instances)
    logger.info(
        "model '%s' version %d: warmed up with %d sample(s) (%s), %d execution(s) on %d instance(s) in %.3f s",
        config.name, version, len(samples), ", ".join(f"'{s.name}'" for s in samples), runs,
        len(instances), seconds(clock) - started,
    )


async def _run_sample(config: ModelConfig, version: int, instance: ModelInstance, sample: WarmupSample) -> None:
    where = f"model '{config.name}' version {version}: warmup sample '{sample.name}' on instance {instance.name}"
    for run in range(sample.count):
        try:
            results = await instance.run(sample.requests)
        except QuiverError as exc:
            raise error_for_code(exc.code, f"{where} failed: {exc}") from None
        except Exception as exc:
            raise InternalError(f"{where} failed: {format_exception(exc)}") from None
        if len(results) != len(sample.requests):
            raise InternalError(
                f"{where}: the model answered {len(results)} of {len(sample.requests)} request(s)"
            )
        for result in results:
            if isinstance(result, QuiverError):
                raise error_for_code(result.code, f"{where} failed (run {run + 1} of {sample.count}): {result}")
