"""The ``sequence_batching`` section of a model configuration, validated and typed:
control inputs, implicit state and the strategy settings. Backends use it to accept the
control and state tensors their models take; the sequence batcher uses it to run them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as pb

from quiver.config.model_config import ModelConfig
from quiver.errors import ConfigError, UnsupportedError
from quiver.types import DataType

#: Triton's default for ``max_sequence_idle_microseconds``.
DEFAULT_MAX_IDLE_US = 1_000_000

_Kind = pb.ModelSequenceBatching.Control
START = _Kind.CONTROL_SEQUENCE_START
END = _Kind.CONTROL_SEQUENCE_END
READY = _Kind.CONTROL_SEQUENCE_READY
CORRID = _Kind.CONTROL_SEQUENCE_CORRID
_KIND_NAMES = {START: "START", END: "END", READY: "READY", CORRID: "CORRID"}
_CORRID_TYPES = (DataType.UINT64, DataType.INT64, DataType.UINT32, DataType.INT32, DataType.BYTES)




@dataclass(frozen=True, slots=True)
class ControlSpec:
    """One control input: the tensor ``name`` carries ``kind`` as ``values[False/True]``."""

    name: str
    kind: int
    datatype: DataType
    values: tuple[Any, Any] = (0, 1)


@dataclass(frozen=True, slots=True)
class StateSpec:
    input_name: str
    output_name: str
    datatype: DataType
    dims: tuple[int, ...]
    initial: Any = None  # numpy array (without the batch dimension), or None for zeros


@dataclass(frozen=True, slots=True)
class SequenceSettings:
    """A validated ``sequence_batching`` section."""

    strategy: str = "direct"  # or "oldest"
    max_idle_ns: int = DEFAULT_MAX_IDLE_US * 1000
    max_queue_delay_ns: int = 0
    max_candidate_sequences: int = 0  # oldest; 0: unlimited
    preferred_batch_sizes: tuple[int, ...] = ()
    controls: tuple[ControlSpec, ...] = ()
    states: tuple[StateSpec, ...] = ()

    @property
    def injected_inputs(self) -> dict[str, DataType]:
        """Inputs the batcher adds to every request (the model has them, the config's
        ``input`` list does not)."""
        names = {c.name: c.datatype for c in self.controls}
        names.update({s.input_name: s.datatype for s in self.states})
        return names

    @property
    def state_outputs(self) -> dict[str, StateSpec]:
        return {s.output_name: s for s in self.states}


def _datatype(value: int) -> DataType:
    return DataType.from_config(pb.DataType.Name(value))


def sequence_settings(config: ModelConfig, version_dir: Path | None = None) -> SequenceSettings:
    """Validate the ``sequence_batching`` section; errors name the model and the field.

    ``version_dir`` is where ``initial_state { data_file }`` files are read from (its
    ``initial_state`` folder, as in Triton); without it such files are not read.
    """
    proto = config.proto.sequence_batching
    model = config.name
    where = f"model '{model}': sequence_batching"
    if proto.iterative_sequence:
        raise UnsupportedError(f"{where}.iterative_sequence is not supported")
    which = proto.WhichOneof("strategy_choice")
    strategy = which or "direct"
    idle_us = int(proto.max_sequence_idle_microseconds) or DEFAULT_MAX_IDLE_US
    delay_ns = 0
    candidates = 0
    preferred: tuple[int, ...] = ()
    if which == "direct":
        delay_ns = int(proto.direct.max_queue_delay_microseconds) * 1000
    elif which == "oldest":
        oldest = proto.oldest
        delay_ns = int(oldest.max_queue_delay_microseconds) * 1000
        candidates = int(oldest.max_candidate_sequences)
        if candidates < 0:
            raise ConfigError(f"{where}.oldest.max_candidate_sequences must be >= 0, got {candidates}")
        limit = max(config.max_batch_size, 1)
        for size in oldest.preferred_batch_size:
            if not 1 <= size <= limit:
                raise ConfigError(
                    f"{where}.oldest.preferred_batch_size {size} must be in 1..max_batch_size ({limit})"
                )
        preferred = tuple(sorted(set(oldest.preferred_batch_size)))

    taken: set[str] = set()

    def claim(name: str, field_name: str) -> None:
        if not name:
            raise ConfigError(f"{where}.{field_name}: 'name' is missing")
        if name in config.input_map:
            raise ConfigError(
                f"{where}.{field_name}: '{name}' is also a model input; control and state "
                "inputs must not be listed in 'input'"
            )
        if name in taken:
            raise ConfigError(f"{where}.{field_name}: tensor '{name}' is used twice")
        taken.add(name)

    controls: list[ControlSpec] = []
    kinds_seen: set[int] = set()
    for index, entry in enumerate(proto.control_input):
        field_name = f"control_input[{index}]"
        claim(entry.name, field_name)
        if len(entry.control) != 1:
            raise ConfigError(
                f"{where}.{field_name} ('{entry.name}') must have exactly one 'control', "
                f"has {len(entry.control)}"
            )
        control = entry.control[0]
        kind = int(control.kind)
        if kind not in _KIND_NAMES:
            raise ConfigError(f"{where}.{field_name}.control: unknown control kind {kind}")
        if kind in kinds_seen:
            raise ConfigError(
                f"{where}.{field_name}: control CONTROL_SEQUENCE_{_KIND_NAMES[kind]} is given twice"
            )
        kinds_seen.add(kind)
        if kind == CORRID:
            if control.data_type == pb.TYPE_INVALID:
                raise ConfigError(
                    f"{where}.{field_name}.control: CONTROL_SEQUENCE_CORRID needs a 'data_type'"
                )
            datatype = _datatype(control.data_type)
            if datatype not in _CORRID_TYPES:
                raise ConfigError(
                    f"{where}.{field_name}.control: CONTROL_SEQUENCE_CORRID 'data_type' must be "
                    f"TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING, got "
                    f"{datatype.config_name}"
                )
            controls.append(ControlSpec(entry.name, kind, datatype))
            continue
        given = [
            (label, values, datatype)
            for label, values, datatype in (
                ("int32_false_true", tuple(control.int32_false_true), DataType.INT32),
                ("fp32_false_true", tuple(control.fp32_false_true), DataType.FP32),
                ("bool_false_true", tuple(control.bool_false_true), DataType.BOOL),
            )
            if values
        ]
        name = f"CONTROL_SEQUENCE_{_KIND_NAMES[kind]}"
        if len(given) != 1:
            raise ConfigError(
                f"{where}.{field_name}.control: {name} needs exactly one of int32_false_true, "
                "fp32_false_true or bool_false_true (the data type comes from it)"
            )
        label, values, datatype = given[0]
        if len(values) != 2:
            raise ConfigError(
                f"{where}.{field_name}.control: {label} must have 2 values (false, true), "
                f"has {len(values)}"
            )
        controls.append(ControlSpec(entry.name, kind, datatype, (values[0], values[1])))

    states: list[StateSpec] = []
    outputs_seen: set[str] = set()
    for index, entry in enumerate(proto.state):
        field_name = f"state[{index}]"
        claim(entry.input_name, f"{field_name}.input_name")
        if not entry.output_name:
            raise ConfigError(f"{where}.{field_name}: 'output_name' is missing")
        if entry.output_name in outputs_seen or entry.output_name in config.input_map:
            raise ConfigError(f"{where}.{field_name}.output_name: '{entry.output_name}' is used twice")
        outputs_seen.add(entry.output_name)
        if entry.data_type == pb.TYPE_INVALID:
            raise ConfigError(
                f"{where}.{field_name} ('{entry.input_name}'): 'data_type' is missing"
            )
        datatype = _datatype(entry.data_type)
        dims = tuple(int(d) for d in entry.dims)
        if not dims or any(d == 0 or d < -1 for d in dims):
            raise ConfigError(
                f"{where}.{field_name} ('{entry.input_name}'): 'dims' {list(dims)} must be "
                "non-empty, each dimension >= 1 or -1"
            )
        initial = None
        if entry.initial_state:
            if len(entry.initial_state) > 1:
                raise ConfigError(
                    f"{where}.{field_name}.initial_state: only one initial state is supported"
                )
            initial = _initial_state(
                entry.initial_state[0], datatype, dims, f"{where}.{field_name}.initial_state", version_dir
            )
        states.append(StateSpec(entry.input_name, entry.output_name, datatype, dims, initial))
    return SequenceSettings(
        strategy=strategy,
        max_idle_ns=idle_us * 1000,
        max_queue_delay_ns=delay_ns,
        max_candidate_sequences=candidates,
        preferred_batch_sizes=preferred,
        controls=tuple(controls),
        states=tuple(states),
    )


def _initial_state(
    proto: Any, datatype: DataType, dims: tuple[int, ...], where: str, version_dir: Path | None
) -> Any:
    if proto.data_type != pb.TYPE_INVALID and _datatype(proto.data_type) is not datatype:
        raise ConfigError(
            f"{where}: 'data_type' {pb.DataType.Name(proto.data_type)} differs from the "
            f"state's {datatype.config_name}"
        )
    shape = tuple(int(d) for d in proto.dims)
    if not shape or any(d < 1 for d in shape):
        raise ConfigError(f"{where}: 'dims' {list(shape)} must be fully specified (each >= 1)")
    if len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape, strict=True)):
        raise ConfigError(f"{where}: 'dims' {list(shape)} do not fit the state's dims {list(dims)}")
    which = proto.WhichOneof("state_data")
    if which == "data_file":
        if datatype is DataType.BYTES:
            raise ConfigError(f"{where}: 'data_file' for a TYPE_STRING state is not supported")
        if version_dir is None:
            return np.zeros(shape, datatype.numpy_dtype)  # validation only, no files at hand
        folder = (version_dir / "initial_state").resolve()
        path = (folder / proto.data_file).resolve()
        if not path.is_relative_to(folder) or not path.is_file():
            raise ConfigError(f"{where}: 'data_file' {proto.data_file} not found in {folder}")
        raw = path.read_bytes()
        want = math.prod(shape) * datatype.itemsize
        if len(raw) != want:
            raise ConfigError(
                f"{where}: 'data_file' {proto.data_file} has {len(raw)} bytes, the state needs {want}"
            )
        return np.frombuffer(raw, dtype=datatype.numpy_dtype).reshape(shape).copy()
    return zeros(datatype, shape)


def zeros(datatype: DataType, shape: tuple[int, ...]) -> Any:
    if datatype is DataType.BYTES:
        array = np.empty(shape, dtype=np.object_)
        array.fill(b"")
        return array
    return np.zeros(shape, datatype.numpy_dtype)
