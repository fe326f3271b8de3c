"""The plan of an ensemble: its steps as a data-flow graph, validated against the
composing models' configurations. Pure: no I/O, no event loop.

Validation errors each name the step (by index and model) and the tensor:
unknown composing models, inputs and outputs a composing model does not have, tensors
consumed but never produced, ensemble outputs never produced, a tensor produced twice,
cycles, and datatype or shape mismatches between a producer and its consumers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quiver.config import ModelConfig, TensorConfig
from quiver.errors import ConfigError
from quiver.types import DataType


@dataclass(frozen=True, slots=True)
class Step:
    index: int
    model_name: str
    model_version: str  # "" for the latest (-1 in the config)
    input_map: tuple[tuple[str, str], ...]  # (model input, ensemble tensor)
    output_map: tuple[tuple[str, str], ...]  # (model output, ensemble tensor)
    #: whether the composing model batches, and its inputs' configured dims (no batch dim):
    #: the scheduler converts tensors between batching and non-batching steps by them.
    batching: bool = False
    input_dims: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def label(self) -> str:
        return f"step {self.index} (model '{self.model_name}')"

    @property
    def consumes(self) -> frozenset[str]:
        return frozenset(tensor for _, tensor in self.input_map)

    @property
    def produces(self) -> frozenset[str]:
        return frozenset(tensor for _, tensor in self.output_map)


@dataclass(frozen=True, slots=True)
class EnsemblePlan:
    name: str
    steps: tuple[Step, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    #: step index -> indices of steps that consume something it produces
    downstream: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: each output's configured dims (its reshape when it has one), no batch dim
    output_dims: tuple[tuple[int, ...], ...] = ()

    @property
    def composing_models(self) -> list[str]:
        return sorted({s.model_name for s in self.steps})


@dataclass(frozen=True, slots=True)
class _Node:
    """What one side says an ensemble tensor is (Triton's ``TensorNode``)."""

    model: str
    datatype: DataType
    dims: tuple[int, ...]
    batching: bool

    @property
    def full_dims(self) -> tuple[int, ...]:
        return (-1, *self.dims) if self.batching else self.dims


def _node(tensor: TensorConfig, model: ModelConfig, *, reshaped: bool = False) -> _Node:
    dims = tensor.reshape if reshaped and tensor.reshape is not None else tensor.dims
    return _Node(model.name, tensor.datatype, tuple(dims), model.max_batch_size > 0)


def _dims_match(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b, strict=True))


def _dims_text(dims: tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def _consistency(known: _Node, other: _Node) -> str:
    """Triton's check of two views of one tensor: the same datatype, and dims that match
    (-1 matches anything), or full dims that match (a batching model's ``[d...]`` is a
    non-batching model's ``[-1, d...]``). The reason they are not, or ""."""
    if known.datatype is not other.datatype:
        return (
            f"inconsistent data type: {known.datatype.config_name} is inferred from model "
            f"{known.model} while {other.datatype.config_name} is inferred from model {other.model}"
        )
    if not _dims_match(known.dims, other.dims) and not _dims_match(known.full_dims, other.full_dims):
        return (
            f"inconsistent shape: {_dims_text(known.full_dims)} is inferred from model "
            f"{known.model} while {_dims_text(other.full_dims)} is inferred from model {other.model}"
        )
    return ""


def composing_models(config: ModelConfig) -> list[str]:
    """The models an ensemble config names, before anything is validated."""
    return sorted({s.model_name for s in config.proto.ensemble_scheduling.step if s.model_name})


def build_plan(config: ModelConfig, models: dict[str, ModelConfig]) -> EnsemblePlan:
    """Validate ``config`` (an ensemble) against its composing models' configs."""
    where = f"{config.source}: ensemble '{config.name}'"
    proto = config.proto.ensemble_scheduling
    if not proto.step:
        raise ConfigError(f"{where}: 'ensemble_scheduling' has no step")
    ensemble_inputs = {t.name: t for t in config.inputs}
    ensemble_outputs = {t.name: t for t in config.outputs}
    if not ensemble_outputs:
        raise ConfigError(f"{where}: declares no output")

    steps: list[Step] = []
    producer: dict[str, tuple[Step, _Node]] = {}
    for index, raw in enumerate(proto.step):
        label = f"step {index} (model '{raw.model_name}')"
        if not raw.model_name:
            raise ConfigError(f"{where}: step {index} has no 'model_name'")
        model = models.get(raw.model_name)
        if model is None:
            raise ConfigError(f"{where}: {label}: unknown model '{raw.model_name}'")
        if model.platform == "ensemble" and model.name == config.name:
            raise ConfigError(f"{where}: {label}: an ensemble cannot contain itself")
        if 0 < model.max_batch_size < config.max_batch_size:
            raise ConfigError(
                f"{where}: ensemble {config.name} allows maximum batch size "
                f"{config.max_batch_size}, but it contains model {model.name} which only allows "
                f"maximum batch size to be {model.max_batch_size}"
            )
        version = "" if raw.model_version in (-1, 0) else str(raw.model_version)
        for model_input in raw.input_map:
            if model.input(model_input) is None:
                raise ConfigError(
                    f"{where}: {label}: input_map names input '{model_input}', which model "
                    f"'{model.name}' does not have (it has: {', '.join(model.input_map)})"
                )
        missing = [t.name for t in model.inputs if not t.optional and t.name not in raw.input_map]
        if missing:
            raise ConfigError(
                f"{where}: {label}: input_map gives no tensor for required input(s) "
                f"{', '.join(missing)} of model '{model.name}'"
            )
        for model_output, tensor in raw.output_map.items():
            out = model.output(model_output)
            if out is None:
                raise ConfigError(
                    f"{where}: {label}: output_map names output '{model_output}', which model "
                    f"'{model.name}' does not have (it has: {', '.join(model.output_map)})"
                )
            if tensor in producer:
                raise ConfigError(
                    f"{where}: {label}: tensor '{tensor}' is already produced by "
                    f"{producer[tensor][0].label}"
                )
            if tensor in ensemble_inputs:
                raise ConfigError(f"{where}: {label}: tensor '{tensor}' is an ensemble input and cannot be produced by a step")
            step_stub = Step(index, raw.model_name, version, (), ())
            producer[tensor] = (step_stub, _node(out, model))
        steps.append(
            Step(
                index,
                raw.model_name,
                version,
                tuple(sorted(raw.input_map.items())),
                tuple(sorted(raw.output_map.items())),
                batching=model.max_batch_size > 0,
                input_dims=tuple((t.name, tuple(t.dims)) for t in model.inputs),
            )
        )

    # Every consumed tensor is produced (or is an ensemble input), with a matching type.
    for step in steps:
        model = models[step.model_name]
        for model_input, tensor in step.input_map:
            consumer = _node(model.input_map[model_input], model)
            if tensor in ensemble_inputs:
                source = _node(ensemble_inputs[tensor], config, reshaped=True)
                what = f"ensemble input '{tensor}'"
            elif tensor in producer:
                source = producer[tensor][1]
                what = f"tensor '{tensor}' (from {producer[tensor][0].label})"
            else:
                raise ConfigError(
                    f"{where}: {step.label}: consumes tensor '{tensor}', which no step produces "
                    "and which is not an ensemble input"
                )
            reason = _consistency(source, consumer)
            if reason:
                raise ConfigError(
                    f"{where}: {step.label}: input '{model_input}' and {what}: ensemble tensor "
                    f"'{tensor}': {reason}"
                )
    for name, tensor in ensemble_outputs.items():
        if name not in producer:
            raise ConfigError(f"{where}: ensemble output '{name}' is produced by no step")
        step_stub, source = producer[name]
        reason = _consistency(_node(tensor, config, reshaped=True), source)
        if reason:
            raise ConfigError(
                f"{where}: ensemble output '{name}' (from {step_stub.label}): ensemble tensor "
                f"'{name}': {reason}"
            )
    unused = [name for name in ensemble_inputs if not any(name in s.consumes for s in steps)]
    if unused:
        raise ConfigError(f"{where}: ensemble input(s) {', '.join(unused)} are consumed by no step")

    downstream = {
        step.index: tuple(
            other.index for other in steps if other.index != step.index and other.consumes & step.produces
        )
        for step in steps
    }
    _check_acyclic(where, steps, downstream)
    output_dims = tuple(
        tuple(t.reshape if t.reshape is not None else t.dims) for t in ensemble_outputs.values()
    )
    return EnsemblePlan(
        config.name,
        tuple(steps),
        tuple(ensemble_inputs),
        tuple(ensemble_outputs),
        downstream,
        output_dims,
    )


def _check_acyclic(where: str, steps: list[Step], downstream: dict[int, tuple[int, ...]]) -> None:
    state: dict[int, int] = {}  # 1 visiting, 2 done

    def visit(index: int, path: list[int]) -> None:
        state[index] = 1
        for nxt in downstream[index]:
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt] if nxt in path else [index, nxt]
                names = " -> ".join(steps[i].label for i in cycle)
                raise ConfigError(f"{where}: the steps form a cycle: {names}")
            if state.get(nxt) is None:
                visit(nxt, [*path, nxt])
        state[index] = 2

    for step in steps:
        if state.get(step.index) is None:
            visit(step.index, [step.index])
