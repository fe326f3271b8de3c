"""EnsembleScheduler: runs an ensemble's steps as data flow.

Each step is an ordinary inference request sent back through the server's inference path
(``infer``), so a composing model batches ensemble traffic with its other traffic; steps
whose inputs are ready run concurrently. A failing step fails the ensemble request with
the step's error code and a message naming the step and its model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from quiver.clock import SYSTEM_CLOCK, Clock
from quiver.ensemble.plan import EnsemblePlan, Step
from quiver.errors import InternalError, QuiverError, error_for_code
from quiver.metrics.statistics import ModelStatistics
from quiver.scheduling.core import CoreScheduler, SchedulerCore, batch_rows
from quiver.types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor

InferFn = Callable[[InferenceRequest], Awaitable[InferenceResponse]]

#: Request parameters an ensemble passes on to its steps.
_PASSED_ON = ("priority", "timeout", "sequence_id", "sequence_start", "sequence_end")


class EnsembleScheduler(CoreScheduler):
    queueing = False  # the composing models queue, not the ensemble

    def __init__(
        self,
        plan: EnsemblePlan,
        infer: InferFn,
        stats: ModelStatistics,
        *,
        batching: bool = False,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._plan = plan
        self._infer = infer
        self._batching = batching
        self._core = SchedulerCore(f"ensemble '{plan.name}'", stats, clock)

    def _step_request(
        self, step: Step, request: InferenceRequest, tensors: dict[str, tuple[Tensor, int]]
    ) -> InferenceRequest:
        inputs = []
        dims = dict(step.input_dims)
        for model_input, name in step.input_map:
            tensor, batch = tensors[name]
            shape = convert_shape(dims[model_input], step.batching, batch, tensor.shape)
            data = tensor.data if shape == tensor.shape else tensor.data.reshape(shape)
            inputs.append(Tensor(model_input, tensor.datatype, shape, data))
        params = {k: request.parameters[k] for k in _PASSED_ON if k in request.parameters}
        return InferenceRequest(
            model_name=step.model_name,
            model_version=step.model_version,
            inputs=inputs,
            outputs=[RequestedOutput(model_output) for model_output, _ in step.output_map],
            id=request.id,
            parameters=params,
            trace=request.trace.spawn() if request.trace is not None else None,
        )

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        core = self._core
        core.open()
        start = core.clock.now()
        with core.accept(start, error_reason="BACKEND"):
            response = await self._run(request)
        elapsed = core.clock.now() - start
        rows = batch_rows(request, self._batching)
        core.stats.record_execution(rows, 0, elapsed, 0)
        core.stats.record_success(elapsed, 0, 0, elapsed, 0, rows)
        return response

    async def _run(self, request: InferenceRequest) -> InferenceResponse:
        plan = self._plan
        # each tensor with its batch size (0: it comes from a side that does not batch)
        tensors: dict[str, tuple[Tensor, int]] = {
            t.name: (t, t.shape[0] if self._batching and t.shape else 0) for t in request.inputs
        }
        waiting = list(plan.steps)
        running: dict[asyncio.Task[InferenceResponse], Step] = {}
        task_batch: dict[asyncio.Task[InferenceResponse], int] = {}

        def launch() -> None:
            for step in list(waiting):
                if all(name in tensors for _, name in step.input_map):
                    waiting.remove(step)
                    step_request = self._step_request(step, request, tensors)
                    task = asyncio.ensure_future(self._infer(step_request))
                    running[task] = step
                    # the batch size of what the step produces (0 when it does not batch)
                    task_batch[task] = batch_rows(step_request, True) if step.batching else 0

        launch()
        try:
            while running:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    step = running.pop(task)
                    try:
                        response = task.result()
                    except QuiverError as exc:
                        raise error_for_code(
                            exc.code, f"ensemble '{plan.name}': {step.label} failed: {exc.message}"
                        ) from None
                    produced = {t.name: t for t in response.outputs}
                    step_batch = task_batch.pop(task)
                    for model_output, name in step.output_map:
                        tensor = produced.get(model_output)
                        if tensor is None:
                            raise InternalError(
                                f"ensemble '{plan.name}': {step.label} returned no output "
                                f"'{model_output}'"
                            )
                        tensors[name] = (Tensor(name, tensor.datatype, tensor.shape, tensor.data), step_batch)
                launch()
        finally:
            if running:
                for task in running:
                    task.cancel()
                # Collect them, so a second failure is not reported as never retrieved.
                await asyncio.gather(*running, return_exceptions=True)
        missing = [name for name in plan.outputs if name not in tensors]
        if missing:  # pragma: no cover - the plan's validation rules this out
            raise InternalError(f"ensemble '{plan.name}': output(s) {', '.join(missing)} were not produced")
        outputs = []
        for name, dims in zip(plan.outputs, plan.output_dims, strict=True):
            tensor, batch = tensors[name]
            shape = convert_shape(dims, self._batching, batch, tensor.shape)
            if shape != tensor.shape:
                tensor = Tensor(name, tensor.datatype, shape, tensor.data.reshape(shape))
            outputs.append(tensor)
        return InferenceResponse(plan.name, "", outputs, request.id)


def _matches(dims: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return len(dims) == len(shape) and all(d == -1 or d == s for d, s in zip(dims, shape, strict=True))


def convert_shape(
    dims: tuple[int, ...], batching: bool, batch: int, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """A tensor's shape as the side that takes it sees it (Triton's ``ReshapeTensorDims``):
    ``dims`` are that side's configured dims (no batch dim), ``batching`` whether it batches,
    ``batch`` the tensor's batch size (0 when it comes from a side that does not batch).
    Only when one side batches and the other does not: a non-batched tensor that matches
    ``dims`` gets a batch of 1 first; a batched tensor of batch 1 that does not match loses
    its batch dim. Anything else goes as it is."""
    if batching == (batch != 0):
        return shape
    if batching:
        return (1, *shape) if _matches(dims, shape) else shape
    if batch == 1 and not _matches(dims, shape) and shape:
        return shape[1:]
    return shape
