"""DALI backend: ``backend: "dali"``, a serialized DALI pipeline (``model.dali``).

``nvidia-dali`` is an optional dependency (``pip install 'quiver[dali]'``); this module is
imported only when a DALI model loads. As in Triton's DALI backend:

* The model file is ``model.dali`` (or ``default_model_filename``): a serialized pipeline. If
  it is not one and its name ends in ``.py``, or else from ``dali.py`` in the version folder,
  a pipeline definition decorated with ``@autoserialize`` is serialized first, in a child
  process (the user's code never runs in the server).
* Inputs are the pipeline's ``external_source`` operators, named as the configuration's
  inputs. With ``max_batch_size > 0`` each row of a request is one sample: a UINT8 ``[N, L]``
  tensor is N encoded files of L bytes (zero padding after a JPEG is harmless), and requests
  batched together are one pipeline batch. Beyond Triton, a BYTES input carries one encoded
  file per row (``[N]`` or ``[N, 1]``), of any lengths.
* Outputs are the pipeline's outputs, in order, named by the configuration's outputs. Each
  request gets its samples stacked: they must share one shape, as Triton's responses do.
* The ``num_threads`` parameter sets the pipeline's CPU threads.

Importing DALI (about 65 MB, once per process) is logged and not charged to a model under
``--model-memory-limit``, as TensorFlow's is not.

**On a machine without a GPU** (DALI sees no CUDA device) a pipeline built for a GPU, such as
the seed's (``device="mixed"`` JPEG decoding, ``device_id=0``), is rewritten before it is
deserialized: every ``mixed`` or ``gpu`` operator becomes its CPU version and the device id
becomes DALI's CPU-only one. The rewrite edits only those fields of the serialized protobuf
(a minimal schema of the fields it reads is built below; every other field passes through
untouched), and its output is bit-identical to the same pipeline built for the CPU. An
operator that DALI's registry has no CPU version of fails the load with a message naming it.
With a GPU, the pipeline runs unchanged on the instance's device (KIND_GPU) or its own.

A sample DALI cannot decode fails its request (400 naming the model and DALI's reason); the
other requests of the same batch are run again without it, and the pipeline, which DALI
invalidates after an error, is rebuilt.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import nvidia.dali as dali
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from nvidia.dali import backend as _dali_backend
from nvidia.dali import types as _dali_types
from nvidia.dali.pipeline import Pipeline as _Pipeline
from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import (
    ExecuteResult,
    InstanceSpec,
    ModelFiles,
    ThreadedInstance,
    format_exception,
)
from quiver.config import ModelConfig
from quiver.config.model_config import DEFAULT_MODEL_FILENAME
from quiver.errors import (
    ConfigError,
    InternalError,
    InvalidArgumentError,
    QuiverError,
    UnavailableError,
)
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

logger = logging.getLogger(__name__)

# DALI's stubs leave out the registry, the device count and deserialize's types.
dali_backend: Any = _dali_backend
dali_types: Any = _dali_types
Pipeline: Any = _Pipeline

#: Triton's fallback pipeline definition in a version folder.
FALLBACK_FILENAME = "dali.py"
#: How long serializing a Python pipeline definition may take.
AUTOSERIALIZE_TIMEOUT_S = 120.0
CPU_ONLY_DEVICE_ID = int(dali_types.CPU_ONLY_DEVICE_ID)
_EXTERNAL_SOURCE = ("ExternalSource", "_ExternalSource")


# --- the serialized pipeline ----------------------------------------------------------------


def _schema() -> Any:
    """Message classes for the fields of DALI's ``PipelineDef`` this module reads or writes
    (field numbers as DALI serializes them). Parsing keeps every other field as an unknown
    field, and serializing writes it back unchanged."""
    field = descriptor_pb2.FieldDescriptorProto
    optional, repeated = field.LABEL_OPTIONAL, field.LABEL_REPEATED
    file = descriptor_pb2.FileDescriptorProto(
        name="quiver_dali_pipeline.proto", package="quiver_dali", syntax="proto2"
    )

    def message(name: str, fields: list[tuple[str, int, int, int, str]]) -> None:
        proto = file.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            entry = proto.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                entry.type_name = type_name

    string, int32, int64 = field.TYPE_STRING, field.TYPE_INT32, field.TYPE_INT64
    msg = field.TYPE_MESSAGE
    message(
        "Argument",
        [
            ("name", 1, string, optional, ""),
            ("strings", 5, string, repeated, ""),
            ("is_vector", 8, field.TYPE_BOOL, optional, ""),
        ],
    )
    message("InputOutput", [("name", 1, string, optional, ""), ("device", 2, string, optional, "")])
    message(
        "OpDef",
        [
            ("name", 1, string, optional, ""),
            ("input", 2, msg, repeated, ".quiver_dali.InputOutput"),
            ("output", 3, msg, repeated, ".quiver_dali.InputOutput"),
            ("args", 4, msg, repeated, ".quiver_dali.Argument"),
            ("inst_name", 5, string, optional, ""),
        ],
    )
    message(
        "PipelineDef",
        [
            ("num_threads", 1, int64, optional, ""),
            ("batch_size", 2, int32, optional, ""),
            ("op", 5, msg, repeated, ".quiver_dali.OpDef"),
            ("pipe_outputs", 7, msg, repeated, ".quiver_dali.InputOutput"),
            ("device_id", 8, int32, optional, ""),
        ],
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("quiver_dali.PipelineDef"))


PipelineDef = _schema()


def _device(op: Any) -> str:
    for arg in op.args:
        if arg.name == "device" and arg.strings:
            return str(arg.strings[0])
    return "cpu"


@dataclass(frozen=True, slots=True)
class PipelineInfo:
    """What the serialized pipeline says: its inputs, outputs, devices and defaults."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    device_id: int
    num_threads: int
    batch_size: int
    devices: dict[str, str]  # operator instance -> device


def parse_pipeline(data: bytes, model: str, filename: str) -> Any:
    message = PipelineDef()
    try:
        message.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"model '{model}': {filename} is not a serialized DALI pipeline: {format_exception(exc)}"
        ) from None
    if not message.op or not message.pipe_outputs:
        raise InvalidArgumentError(
            f"model '{model}': {filename} is not a serialized DALI pipeline (no operators or no "
            "outputs)"
        )
    return message


def describe(message: Any) -> PipelineInfo:
    inputs = tuple(
        op.inst_name or (op.output[0].name if op.output else "")
        for op in message.op
        if op.name in _EXTERNAL_SOURCE
    )
    return PipelineInfo(
        inputs=inputs,
        outputs=tuple(o.name for o in message.pipe_outputs),
        device_id=int(message.device_id),
        num_threads=int(message.num_threads),
        batch_size=int(message.batch_size),
        devices={op.inst_name or op.name: _device(op) for op in message.op},
    )


def cpu_rewrite(message: Any, model: str) -> tuple[bytes, list[str]]:
    """The pipeline with every ``mixed``/``gpu`` operator made its CPU version, its data on the
    CPU and DALI's CPU-only device id; and the operators rewritten. An operator with no CPU
    version is an UNAVAILABLE error naming it."""
    rewritten = PipelineDef()
    rewritten.CopyFrom(message)
    cpu_ops = set(dali_backend.RegisteredCPUOps())
    changed: list[str] = []
    for op in rewritten.op:
        device = _device(op)
        if device == "cpu":
            continue
        if op.name not in cpu_ops:
            raise UnavailableError(
                f"model '{model}': DALI operator '{op.name}' (instance '{op.inst_name}', "
                f"device '{device}') has no CPU version in DALI {dali.__version__}, and DALI "
                "sees no GPU here: the pipeline cannot run on this machine"
            )
        for arg in op.args:
            if arg.name == "device":
                arg.strings[:] = ["cpu"]
        for edge in [*op.input, *op.output]:
            edge.device = "cpu"
        changed.append(f"{op.inst_name or op.name} ({device})")
    for output in rewritten.pipe_outputs:
        output.device = "cpu"
    rewritten.device_id = CPU_ONLY_DEVICE_ID
    return rewritten.SerializeToString(), changed


def gpu_count() -> int:
    try:
        return int(dali_backend.GetCUDADeviceCount())
    except Exception:
        return 0


# --- autoserialization ----------------------------------------------------------------------

_AUTOSERIALIZE = r"""
import importlib.util, inspect, sys
path, target, cpu_only = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
spec = importlib.util.spec_from_file_location("quiver_dali_autoserialize", path)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
found = [f for _, f in inspect.getmembers(module, inspect.isfunction)
         if getattr(f, "_is_autoserialize", False)]
if len(found) != 1:
    sys.exit(f"precisely one @autoserialize pipeline definition must exist in {path}; found {len(found)}")
pipe = found[0](device_id=None) if cpu_only else found[0]()
pipe.serialize(filename=target)
"""


def autoserialize(path: Path, model: str) -> bytes:
    """Serialize the ``@autoserialize`` pipeline definition in ``path`` in a child process.
    Without a GPU it is built with ``device_id=None`` (DALI cannot serialize a GPU pipeline
    without CUDA); the CPU rewrite then applies as to any GPU pipeline."""
    with tempfile.TemporaryDirectory(prefix="quiver-dali-") as folder:
        target = Path(folder) / "model.dali"
        command = [sys.executable, "-c", _AUTOSERIALIZE, str(path), str(target), "1" if gpu_count() == 0 else "0"]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=AUTOSERIALIZE_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            raise InvalidArgumentError(
                f"model '{model}': serializing the DALI pipeline in {path.name} took longer than "
                f"{AUTOSERIALIZE_TIMEOUT_S:.0f} s"
            ) from None
        if done.returncode != 0 or not target.is_file():
            lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
            reason = lines[-1] if lines else f"exit status {done.returncode}"
            raise InvalidArgumentError(
                f"model '{model}': cannot serialize the DALI pipeline defined in {path.name}: {reason}"
            )
        return target.read_bytes()


def load_pipeline_file(config_filename: str, files: ModelFiles, model: str) -> tuple[bytes, str]:
    """The serialized pipeline, found as Triton's DALI backend finds it; and its file name."""
    filename = config_filename or DEFAULT_MODEL_FILENAME["dali"]
    path = files.version_dir / filename
    fallback = files.version_dir / FALLBACK_FILENAME
    if path.is_file():
        data = path.read_bytes()
        try:
            parse_pipeline(data, model, filename)
            return data, filename
        except QuiverError:
            if not filename.endswith(".py") and not fallback.is_file():
                raise
        if filename.endswith(".py"):
            return autoserialize(path, model), filename
    if fallback.is_file():
        return autoserialize(fallback, model), FALLBACK_FILENAME
    raise InvalidArgumentError(
        f"model '{model}' version {files.version}: no DALI pipeline: neither {path} nor "
        f"{fallback} exists"
    )


# --- instances ------------------------------------------------------------------------------


class DaliInstance(ThreadedInstance):
    """One DALI pipeline; requests batched together are one pipeline batch."""

    def __init__(
        self, config: ModelConfig, serialized: bytes, device_id: int | None, num_threads: int, name: str
    ) -> None:
        super().__init__(name)
        self._config = config
        self._serialized = serialized
        self._device_id = device_id
        self._num_threads = num_threads
        self._batching = config.max_batch_size > 0
        self._batch_size = max(config.max_batch_size, 1)
        self._inputs = {t.name: t for t in config.inputs}
        self._outputs = [o.name for o in config.outputs]
        self._out_cfg = {o.name: o for o in config.outputs}
        self._pipe = self._build()

    def _build(self) -> Any:
        try:
            pipe = Pipeline.deserialize(
                serialized_pipeline=self._serialized,
                batch_size=self._batch_size,
                num_threads=self._num_threads,
                device_id=self._device_id,
            )
            pipe.build()
        except Exception as exc:
            raise InvalidArgumentError(
                f"model '{self._config.name}': DALI {dali.__version__} cannot load the pipeline: "
                f"{_dali_message(exc)} (a pipeline serialized by another DALI version? serialize "
                f"it again with DALI {dali.__version__})"
            ) from None
        return pipe

    def _samples(self, request: InferenceRequest) -> dict[str, list[Any]]:
        samples: dict[str, list[Any]] = {}
        for tensor in request.inputs:
            data = tensor.data
            if tensor.datatype is DataType.BYTES:
                rows = data.reshape(data.shape[0], -1) if self._batching and data.ndim else data.reshape(1, -1)
                if rows.shape[1] != 1:
                    raise InvalidArgumentError(
                        f"model '{self._config.name}': BYTES input '{tensor.name}' must carry one "
                        f"encoded file per row, got shape {list(data.shape)}"
                    )
                samples[tensor.name] = [
                    np.frombuffer(bytes(v), dtype=np.uint8) for v in rows[:, 0]
                ]
            elif self._batching:
                samples[tensor.name] = [np.ascontiguousarray(row) for row in data]
            else:
                samples[tensor.name] = [np.ascontiguousarray(data)]
        counts = {len(v) for v in samples.values()}
        if len(counts) > 1:
            raise InvalidArgumentError(
                f"model '{self._config.name}': every input of a request must have the same "
                "batch size"
            )
        return samples

    def _run(self, parts: list[dict[str, list[Any]]]) -> list[list[Any]]:
        """Run one pipeline batch of ``parts`` (one per request); the outputs' samples."""
        feed: dict[str, list[Any]] = {name: [] for name in self._inputs}
        for part in parts:
            for name in feed:
                feed[name].extend(part[name])
        try:
            for name, samples in feed.items():
                self._pipe.feed_input(name, samples)
            outputs = self._pipe.run()
            result = []
            for output in outputs:
                if not isinstance(output, dali_backend.TensorListCPU):
                    output = output.as_cpu()
                result.append([np.array(output[i]) for i in range(len(output))])
            return result
        except Exception as exc:
            self._rebuild()
            message = _dali_message(exc)
            if "decoders" in message:
                message += " (a sample that is not an image DALI can decode?)"
            raise InvalidArgumentError(f"model '{self._config.name}': DALI failed: {message}") from None

    def _rebuild(self) -> None:
        """DALI invalidates a pipeline after an error: make a new one."""
        try:
            del self._pipe
            self._pipe = self._build()
        except QuiverError:
            logger.exception("model '%s': cannot rebuild the DALI pipeline", self._config.name)

    def _response(self, request: InferenceRequest, names: list[str], samples: list[list[Any]]) -> InferenceResponse:
        tensors = []
        for name, values in zip(self._outputs, samples, strict=True):
            if name not in names:
                continue
            cfg = self._out_cfg[name]
            shapes = {v.shape for v in values}
            if len(shapes) != 1:
                raise InvalidArgumentError(
                    f"model '{self._config.name}': output '{name}' has samples of different shapes "
                    f"({', '.join(str(list(s)) for s in sorted(shapes))}) in one request; a "
                    "response tensor has one shape"
                )
            array = np.stack(values) if self._batching else values[0]
            if array.dtype != cfg.datatype.numpy_dtype:
                raise InternalError(
                    f"model '{self._config.name}': output '{name}' is {array.dtype} in the DALI "
                    f"pipeline but {cfg.datatype.config_name} in the configuration"
                )
            tensors.append(Tensor(name, cfg.datatype, tuple(array.shape), array))
        return InferenceResponse(self._config.name, "", tensors, request.id)

    def _names(self, request: InferenceRequest) -> list[str]:
        if request.outputs is None:
            return self._outputs
        return [o.name for o in request.outputs]

    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        timing = self.timing
        t0 = time.monotonic_ns()
        parts: list[dict[str, list[Any]] | None] = []
        results: list[InferenceResponse | QuiverError | None] = []
        for request in requests:
            try:
                parts.append(self._samples(request))
                results.append(None)
            except QuiverError as exc:
                parts.append(None)
                results.append(exc)
        pending = [i for i, part in enumerate(parts) if part is not None]
        t1 = time.monotonic_ns()
        self._execute(requests, parts, pending, results)
        t2 = time.monotonic_ns()
        timing.input_ns = t1 - t0
        timing.infer_ns = t2 - t1
        done: ExecuteResult = []
        for result in results:
            done.append(result if result is not None else InternalError("DALI produced no answer"))
        return done

    def _execute(
        self,
        requests: list[InferenceRequest],
        parts: list[dict[str, list[Any]] | None],
        pending: list[int],
        results: list[InferenceResponse | QuiverError | None],
    ) -> None:
        if not pending:
            return
        if not self._batching:
            for i in pending:
                self._execute_batch(requests, parts, [i], results, isolate=False)
            return
        self._execute_batch(requests, parts, pending, results, isolate=len(pending) > 1)

    def _execute_batch(
        self,
        requests: list[InferenceRequest],
        parts: list[dict[str, list[Any]] | None],
        indices: list[int],
        results: list[InferenceResponse | QuiverError | None],
        *,
        isolate: bool,
    ) -> None:
        chosen = [parts[i] for i in indices]
        try:
            samples = self._run([p for p in chosen if p is not None])
        except QuiverError as exc:
            if not isolate:
                for i in indices:
                    results[i] = exc
                return
            for i in indices:  # find the request DALI could not process; serve the others
                self._execute_batch(requests, parts, [i], results, isolate=False)
            return
        offset = 0
        for i in indices:
            part = parts[i]
            assert part is not None
            count = len(next(iter(part.values()))) if part else 0
            mine = [values[offset : offset + count] for values in samples]
            offset += count
            try:
                results[i] = self._response(requests[i], self._names(requests[i]), mine)
            except QuiverError as exc:
                results[i] = exc

    def release(self) -> None:
        del self._pipe


def _dali_message(exc: BaseException) -> str:
    """DALI's errors carry the pipeline definition's traceback; keep what says what failed."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    kept = [
        line for line in lines
        if not line.startswith(("File ", "Current pipeline object", "which was used in", "Critical error in pipeline"))
        and not line.startswith(("images =", "data ="))
    ]
    text = " ".join(kept or lines) or type(exc).__name__
    return text if len(text) <= 600 else text[:600] + "..."


# --- backend --------------------------------------------------------------------------------


class DaliBackend:
    name = "dali"

    def auto_complete(self, config: pb.ModelConfig, files: ModelFiles, strict: bool) -> None:
        """Nothing to fill: inputs, outputs and max_batch_size come from the configuration."""

    def create_instance(
        self, config: ModelConfig, files: ModelFiles, spec: InstanceSpec
    ) -> DaliInstance:
        data, filename = load_pipeline_file(config.proto.default_model_filename, files, config.name)
        message = parse_pipeline(data, config.name, filename)
        info = describe(message)
        missing = [t.name for t in config.inputs if t.name not in info.inputs]
        if missing:
            raise ConfigError(
                f"{config.source}: model '{config.name}': input(s) {', '.join(missing)} are not "
                f"external sources of the DALI pipeline; it has: {', '.join(info.inputs) or 'none'} "
                "(name each fn.external_source as its input)"
            )
        unfed = [name for name in info.inputs if name not in config.input_map]
        if unfed:
            raise ConfigError(
                f"{config.source}: model '{config.name}': the DALI pipeline's external source(s) "
                f"{', '.join(unfed)} are not configured inputs"
            )
        if len(config.outputs) != len(info.outputs):
            raise ConfigError(
                f"{config.source}: model '{config.name}' declares {len(config.outputs)} output(s) "
                f"but the DALI pipeline has {len(info.outputs)}"
            )
        threads = _num_threads(config, info)
        gpus = gpu_count()
        serialized = data
        device_id: int | None
        if gpus == 0:
            serialized, changed = cpu_rewrite(message, config.name)
            device_id = None
            if changed:
                logger.info(
                    "model '%s': no GPU for DALI here; running on the CPU with %s made CPU operators",
                    config.name,
                    ", ".join(changed),
                )
        elif spec.group.kind == "KIND_GPU":
            device_id = spec.device_id
        else:
            device_id = None if info.device_id == CPU_ONLY_DEVICE_ID else info.device_id
        name = f"{config.name}_{files.version}_{spec.name}"
        return DaliInstance(config, serialized, device_id, threads, name)


def _num_threads(config: ModelConfig, info: PipelineInfo) -> int:
    text = config.parameters.get("num_threads", "").strip()
    if not text:
        return max(info.num_threads, 1)
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"{config.source}: parameter 'num_threads' of model '{config.name}' must be a "
            f"positive integer, got '{config.parameters['num_threads']}'"
        )
    return min(value, os.cpu_count() or value)


BACKEND = DaliBackend()
