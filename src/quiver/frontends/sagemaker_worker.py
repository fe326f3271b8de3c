"""SageMaker in a frontend worker process (``--frontend-workers N``).

An inference (``POST /invocations``, ``POST /models/{name}/invoke``) is read, decoded and
answered in the worker with the very :class:`~quiver.frontends.sagemaker.SageMakerFrontend`
code the single process runs (body limits, ``Content-Encoding``, the binary+json content
type, response encoding), over a :class:`~quiver.frontends.remote_service.RemoteService`: the
model side names the model it runs on (single-model mode's default model, a multi-model
endpoint's TargetModel, an invoke's name; one small round trip), then infers it. Every other
route (``/ping``, the multi-model API, ``/invocations`` as the generate extension) is answered
whole by the model side's own SageMaker application, so it answers exactly as in one process.
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from quiver.frontends.http_worker import forward_http
from quiver.frontends.remote_service import RemoteService
from quiver.frontends.sagemaker import SageMakerFrontend, SageMakerSettings, _Reply


class WorkerSageMakerFrontend(SageMakerFrontend):
    """The SageMaker routes in a worker: inferences here, the rest on the model side."""

    def __init__(self, remote: RemoteService, settings: SageMakerSettings, *, max_input_size: int) -> None:
        super().__init__(remote, settings, max_input_size=max_input_size)  # type: ignore[arg-type]
        self.remote = remote

    def _inference(self, method: str, path: str) -> bool:
        if method != "POST":
            return False
        if path == "/invocations":
            return self.settings.inference_type == "infer"
        if not path.startswith("/models/"):
            return False
        parts = path[len("/models/") :].split("/")
        return len(parts) == 2 and bool(parts[0]) and parts[1] == "invoke"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if self._inference(scope["method"], scope["path"]):
            await super().__call__(scope, receive, send)
        else:
            await forward_http(self.remote, "sagemaker", scope, receive, send, self.max_input_size)

    async def _invocations(self, scope: Scope, receive: Receive) -> _Reply | None:
        model = await self.remote.sagemaker_model("invocations", self.target_of(scope))
        return await self._infer(model, scope, receive)

    async def _invoke_named(self, name: str, scope: Scope, receive: Receive) -> _Reply | None:
        return await self._infer(await self.remote.sagemaker_model("invoke", name), scope, receive)


__all__ = ["WorkerSageMakerFrontend"]
