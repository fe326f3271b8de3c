"""The two Ray Serve deployments of ``quiver serve --ray``.

``QuiverIngress`` takes every HTTP request from Ray Serve's proxy, finds the model it is for
(:func:`quiver.rayserve.routing.route`) and passes it to a ``QuiverReplica`` through a
deployment handle with that model as the multiplexed model id, so Ray routes it to a replica
that holds the model, or, when none does or those are full, to the replica with the fewest
models, which then loads it. A hot model therefore ends up on more than one replica under load.

Each ``QuiverReplica`` runs Quiver's own repository manager (its memory budget, eviction, disk
cache and on-demand loads) and answers with the single-process server's own v2 and SageMaker
ASGI applications, in process. Ray's view of which replica holds which model follows Quiver's:
an inference names its model to Ray's multiplexing as it arrives (so Ray sends the next ones
here while it loads; the load itself is Quiver's, once), the replica adds a model when Quiver
makes it resident and removes it when Quiver unloads or evicts it (listener on the manager),
and Ray pushes that set to its routers within 0.1 s. Ray never evicts by itself (no
per-replica model count). Every routing statistics period the replica also compares the two
sets and repairs any difference. SageMaker names of registered models count as theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Coroutine
from typing import Any

import orjson
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response

from quiver.rayserve.cache_slots import CacheSlot
from quiver.rayserve.forward import ForwardedRequest, ForwardedResponse, call_asgi
from quiver.rayserve.routing import SAGEMAKER, route
from quiver.runner import StartError, assemble, load_models
from quiver.settings import Settings

logger = logging.getLogger("quiver.ray")

#: Where ``@serve.multiplexed`` keeps its per-replica state on the instance (Ray 2.60).
_MULTIPLEX_ATTRIBUTE = "__serve_multiplex_wrapper"
#: Response header naming the replica that answered (for operators and tests).
REPLICA_HEADER = b"quiver-replica"


class Resident:
    """What Ray's multiplexing holds for a model Quiver has resident on a replica."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class QuiverReplica:
    """One Quiver model manager, and the v2 and SageMaker applications over it."""

    async def __init__(self, settings: Settings) -> None:  # type: ignore[misc]  # Ray awaits it
        self.cache_slot: CacheSlot | None = None
        if settings.model_cache_dir is not None:
            # One disk cache per process: replicas sharing a node take numbered sub-folders.
            self.cache_slot = CacheSlot(settings.model_cache_dir)
            settings = dataclasses.replace(settings, model_cache_dir=self.cache_slot.folder)
        self.settings = settings
        parts = assemble(settings)
        assert parts.sagemaker is not None  # --ray always has the SageMaker routes
        self.manager = parts.manager
        self.service = parts.service
        self.v2 = parts.http.app()
        self.sagemaker = parts.sagemaker
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id if context is not None else str(os.getpid())
        self.manager.add_residency_listener(self._residency_changed)
        try:
            await load_models(parts, settings)
        except BaseException as exc:
            await self.manager.stop()
            if self.cache_slot is not None:
                self.cache_slot.release()
            if isinstance(exc, StartError):
                raise RuntimeError(str(exc)) from None
            raise
        self.service.ready = True
        for name in self.served_names():  # loaded at start: Ray learns them now
            await self.resident(name)
        self._stopping = False
        logger.info("Quiver replica %s (pid %d) ready", self.replica, os.getpid())

    # -- requests ----------------------------------------------------------------------

    async def handle(self, request: ForwardedRequest, infer: bool = False) -> ForwardedResponse:
        model = serve.get_multiplexed_model_id()
        if model and infer:
            # Ray routes the model's next requests here from now on; Quiver loads it (once)
            # as the application serves this one.
            await self.resident(model)
        if request.api == SAGEMAKER:
            if request.registration is not None and model and model not in self.sagemaker.registered:
                await self._replay_registration(request.registration)
            response = await call_asgi(self.sagemaker, request)
        else:
            response = await call_asgi(self.v2, request)
        if model and infer and not self._serves(model):
            self._residency_changed(model, False)  # it failed to load, or is gone again
        elif model and not infer and response.status == 200 and self._serves(model) and (
            request.api == SAGEMAKER and request.method == "POST" and request.path.rstrip("/") == "/models"
        ):
            await self.resident(model)  # a SageMaker registration: Ray learns the name now
        response.headers.append((REPLICA_HEADER, self.replica.encode()))
        return response

    async def _replay_registration(self, body: bytes) -> None:
        registration = ForwardedRequest(
            SAGEMAKER, "POST", "/models", b"/models", b"", [(b"content-type", b"application/json")], body
        )
        answer = await call_asgi(self.sagemaker, registration)
        if answer.status != 200:
            logger.info("replaying a SageMaker registration answered %d: %r", answer.status, answer.body[:200])

    @serve.multiplexed(max_num_models_per_replica=-1)  # type: ignore[untyped-decorator]
    async def resident(self, model_id: str) -> Resident:
        """Ray's multiplexing calls this for a model it does not list here yet: it only records
        the name (Ray's lock around it is held for no longer than that)."""
        return Resident(model_id)

    # -- Ray's view of this replica, kept in step with Quiver's ----------------------------

    def _multiplexed(self) -> Any:
        return getattr(self, _MULTIPLEX_ATTRIBUTE, None)

    def _residency_changed(self, name: str, resident: bool) -> None:
        wrapper = self._multiplexed()
        models = getattr(wrapper, "models", None)
        if wrapper is None or not isinstance(models, dict) or "::" in name:
            return  # nothing multiplexed yet (the first inference sets it up); archive members
        if resident and name not in models:
            models[name] = Resident(name)
        elif not resident and name in models:
            del models[name]
        else:
            return
        wrapper._push_multiplexed_replica_info = True  # Ray pushes the set within 0.1 s

    def served_names(self) -> set[str]:
        """The names requests reach this replica's READY models by: models (not archive
        members), and the SageMaker names and target-model values of registered ones."""
        names = {m.name for m in self.manager.ready_models if "::" not in m.name}
        return names | set(self.sagemaker.aliases())

    def _serves(self, name: str) -> bool:
        return self.manager.is_ready(name) or name in self.sagemaker.aliases()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Called by Ray every routing-statistics period (on the event loop, as the manager
        and Ray's multiplexing are used): repairs any difference between Ray's multiplexed
        set and the names served here, and reports both."""
        resident = self.served_names()
        wrapper = self._multiplexed()
        models = getattr(wrapper, "models", None)
        if isinstance(models, dict):
            for name in set(models) - resident:
                self._residency_changed(name, False)
            for name in resident - set(models):
                self._residency_changed(name, True)
            loading = getattr(wrapper, "_model_load_tasks", None)
            if isinstance(loading, set) and loading - resident:
                loading &= resident  # names left behind by a cancelled request
                wrapper._push_multiplexed_replica_info = True
        used, limit = self.manager.memory
        return {
            "quiver_resident_models": sorted(resident),
            "quiver_memory_used_bytes": used,
            "quiver_memory_limit_bytes": limit,
        }

    async def check_health(self) -> None:
        if not self.service.ready:
            raise RuntimeError("the Quiver replica is stopping")

    def __del__(self) -> Coroutine[Any, Any, None] | None:
        """Ray calls this after draining the replica's in-flight requests (scale-in, shutdown)
        and awaits what it returns; the garbage collector's later call finds nothing to do."""
        if getattr(self, "_stopping", True):  # never started, or stopped already
            return None
        self._stopping = True
        return self._shutdown()

    async def _shutdown(self) -> None:
        self.service.ready = False
        try:
            await self.manager.stop()
        finally:
            if self.cache_slot is not None:
                self.cache_slot.release()


class QuiverIngress:
    """Ray Serve's HTTP entry: routes each request by model to a QuiverReplica."""

    def __init__(self, replicas: DeploymentHandle[Any], max_input_size: int, retries: int) -> None:
        self.replicas = replicas
        self.max_input_size = max_input_size
        self.retries = retries
        #: SageMaker name -> the body of its ``POST /models``, replayed on replicas that lack it.
        self.registrations: dict[str, bytes] = {}

    async def __call__(self, request: Request) -> Response:
        scope = request.scope
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers.raw}
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_input_size:
            return _error(413, f"request body of {int(length)} bytes exceeds the limit of {self.max_input_size} bytes (--http-max-input-size)")
        body = await request.body()
        if len(body) > self.max_input_size:
            return _error(413, f"request body exceeds the limit of {self.max_input_size} bytes (--http-max-input-size)")
        path: str = scope["path"]
        where = route(request.method, path, headers)
        model = where.model
        registering = where.api == SAGEMAKER and request.method == "POST" and path.rstrip("/") == "/models"
        if registering:
            with contextlib.suppress(Exception):
                model = str(orjson.loads(body).get("model_name") or "")
        forwarded = ForwardedRequest(
            where.api,
            request.method,
            path,
            scope.get("raw_path") or path.encode(),
            scope.get("query_string", b""),
            list(request.headers.raw),
            body,
            self.registrations.get(model) if where.api == SAGEMAKER and model else None,
        )
        handle = self.replicas.options(multiplexed_model_id=model) if model else self.replicas
        answer = await self._send(handle, forwarded, model, where.infer)
        if where.api == SAGEMAKER and model and answer.status == 200:
            if registering:
                self.registrations[model] = body
            elif request.method == "DELETE":
                self.registrations.pop(model, None)
        response = Response(answer.body, status_code=answer.status)
        response.raw_headers = [
            *((k, v) for k, v in answer.headers if k.lower() != b"content-length"),
            (b"content-length", str(len(answer.body)).encode()),
        ]
        return response

    async def _send(
        self, handle: DeploymentHandle[Any], request: ForwardedRequest, model: str, infer: bool
    ) -> ForwardedResponse:
        """Send to a replica; when the replica dies mid-request, try another (an inference
        holds no state across requests; a request that crashes every replica it reaches stops
        after ``--ray-request-retries``), then give up with 503."""
        what = f"model '{model}'" if model else "the request"
        for attempt in range(self.retries + 1):
            try:
                result: ForwardedResponse = await handle.handle.remote(request, infer)
                return result
            except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
                logger.warning("the replica answering %s died (attempt %d): %s", what, attempt + 1, exc)
                if attempt == self.retries:
                    return ForwardedResponse(
                        503,
                        [(b"content-type", b"application/json")],
                        orjson.dumps(
                            {
                                "error": f"the Ray Serve replica answering {what} died mid-request, "
                                f"and {self.retries} retr{'y' if self.retries == 1 else 'ies'} on other "
                                f"replicas failed too: {type(exc).__name__}"
                            }
                        ),
                    )
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")


def _error(status: int, message: str) -> Response:
    return Response(orjson.dumps({"error": message}), status_code=status, media_type="application/json")
