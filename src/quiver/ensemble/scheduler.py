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

    def _step_request(self, step: Step, request: InferenceRequest, tensors: dict[str, Tensor]) -> InferenceRequest:
        inputs = []
        for model_input, name in step.input_map:
            tensor = tensors[name]
            inputs.append(Tensor(model_input, tensor.datatype, tensor.shape, tensor.data))
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
        tensors: dict[str, Tensor] = {t.name: t for t in request.inputs}
        waiting = list(plan.steps)
        running: dict[asyncio.Task[InferenceResponse], Step] = {}

        def launch() -> None:
            for step in list(waiting):
                if all(name in tensors for _, name in step.input_map):
                    waiting.remove(step)
                    task = asyncio.ensure_future(self._infer(self._step_request(step, request, tensors)))
                    running[task] = step

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
                    for model_output, name in step.output_map:
                        tensor = produced.get(model_output)
                        if tensor is None:
                            raise InternalError(
                                f"ensemble '{plan.name}': {step.label} returned no output "
                                f"'{model_output}'"
                            )
                        tensors[name] = Tensor(name, tensor.datatype, tensor.shape, tensor.data)
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
        outputs = [tensors[name] for name in plan.outputs]
        return InferenceResponse(plan.name, "", outputs, request.id)
