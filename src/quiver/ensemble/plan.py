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


@dataclass(frozen=True, slots=True)
class Step:
    index: int
    model_name: str
    model_version: str  # "" for the latest (-1 in the config)
    input_map: tuple[tuple[str, str], ...]  # (model input, ensemble tensor)
    output_map: tuple[tuple[str, str], ...]  # (model output, ensemble tensor)

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

    @property
    def composing_models(self) -> list[str]:
        return sorted({s.model_name for s in self.steps})


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
    producer: dict[str, tuple[Step, TensorConfig]] = {}
    for index, raw in enumerate(proto.step):
        label = f"step {index} (model '{raw.model_name}')"
        if not raw.model_name:
            raise ConfigError(f"{where}: step {index} has no 'model_name'")
        model = models.get(raw.model_name)
        if model is None:
            raise ConfigError(f"{where}: {label}: unknown model '{raw.model_name}'")
        if model.platform == "ensemble" and model.name == config.name:
            raise ConfigError(f"{where}: {label}: an ensemble cannot contain itself")
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
            producer[tensor] = (step_stub, _with_batch(out, model))
        steps.append(
            Step(
                index,
                raw.model_name,
                version,
                tuple(sorted(raw.input_map.items())),
                tuple(sorted(raw.output_map.items())),
            )
        )

    # Every consumed tensor is produced (or is an ensemble input), with a matching type.
    for step in steps:
        model = models[step.model_name]
        for model_input, tensor in step.input_map:
            consumer = _with_batch(model.input_map[model_input], model)
            if tensor in ensemble_inputs:
                source = _with_batch(ensemble_inputs[tensor], config)
                what = f"ensemble input '{tensor}'"
            elif tensor in producer:
                source = producer[tensor][1]
                what = f"tensor '{tensor}' (from {producer[tensor][0].label})"
            else:
                raise ConfigError(
                    f"{where}: {step.label}: consumes tensor '{tensor}', which no step produces "
                    "and which is not an ensemble input"
                )
            _check_match(where, step, model_input, consumer, what, source)
    for name, tensor in ensemble_outputs.items():
        if name not in producer:
            raise ConfigError(f"{where}: ensemble output '{name}' is produced by no step")
        step_stub, source = producer[name]
        if source.datatype is not tensor.datatype:
            raise ConfigError(
                f"{where}: ensemble output '{name}' is {tensor.datatype.value} but "
                f"{step_stub.label} produces {source.datatype.value}"
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
    return EnsemblePlan(
        config.name, tuple(steps), tuple(ensemble_inputs), tuple(ensemble_outputs), downstream
    )


def _with_batch(tensor: TensorConfig, model: ModelConfig) -> TensorConfig:
    """The tensor with its full shape (batch dimension as -1 when the model batches)."""
    return TensorConfig(
        tensor.name, tensor.datatype, tuple(tensor.full_shape(model.max_batch_size)), tensor.reshape
    )


def _check_match(
    where: str, step: Step, model_input: str, consumer: TensorConfig, what: str, source: TensorConfig
) -> None:
    if consumer.datatype is not source.datatype:
        raise ConfigError(
            f"{where}: {step.label}: input '{model_input}' is {consumer.datatype.value} but "
            f"{what} is {source.datatype.value}"
        )
    a, b = consumer.dims, source.dims
    compatible = len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b, strict=True))
    if not compatible:
        raise ConfigError(
            f"{where}: {step.label}: input '{model_input}' has shape {list(a)} but {what} has "
            f"shape {list(b)}"
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
