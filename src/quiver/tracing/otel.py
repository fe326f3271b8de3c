"""``--trace-config mode=opentelemetry``: traces as OpenTelemetry spans, exported over
OTLP/HTTP with the OpenTelemetry SDK's batch span processor (``pip install 'quiver[trace]'``).

The spans are Triton's: an ``InferRequest`` root span with the frontend's events
(``HTTP_RECV_START`` ... ``INFER_RESPONSE_COMPLETE``, ``HTTP_SEND_END``); under it a span
named after the model with ``REQUEST_START``, ``QUEUE_START`` and ``REQUEST_END`` and the
attributes ``triton.model_name``, ``triton.model_version``, ``triton.trace_id``,
``triton.trace_parent_id`` (and ``triton.request_id``); under that a ``compute`` span with
the compute events, and the model spans of the requests it spawned (ensemble steps). A
request whose client propagated a W3C ``traceparent`` is always traced, its root span a
child of the client's. Timestamps taken on the steady clock are placed on the wall clock
by the offset between the two at start, as Triton does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from quiver.tracing.config import DEFAULT_OTEL_URL, TraceConfig
from quiver.tracing.trace import Trace, TraceGroup, now

logger = logging.getLogger(__name__)

_MODEL_EVENTS = frozenset(("REQUEST_START", "QUEUE_START", "REQUEST_END"))
_COMPUTE_EVENTS = frozenset(("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"))


class MissingOpenTelemetry(RuntimeError):
    pass


class OpenTelemetryExporter:
    """Spans for released trace groups, batched and exported to the OTLP/HTTP ``url``."""

    def __init__(self, config: TraceConfig) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise MissingOpenTelemetry(
                f"--trace-config mode=opentelemetry needs the OpenTelemetry SDK and its OTLP/HTTP "
                f"exporter: pip install 'quiver[trace]' ({exc})"
            ) from None
        url = DEFAULT_OTEL_URL
        attributes: dict[str, str] = {"service.name": "triton-inference-server"}
        options: dict[str, int] = {}
        for key, value in config.options:
            if key == "url":
                url = value if "://" in value else f"http://{value}"
            elif key == "resource":
                name, _, text = value.partition("=")
                attributes[name] = text
            elif key.startswith("bsp_"):
                options[key] = int(value)
        self.url = url
        self._provider = TracerProvider(resource=Resource.create(attributes))
        self._provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=url),
                max_queue_size=options.get("bsp_max_queue_size"),
                schedule_delay_millis=options.get("bsp_schedule_delay"),
                max_export_batch_size=options.get("bsp_max_export_batch_size"),
            )
        )
        self._tracer = self._provider.get_tracer("triton-server")
        self._propagator = TraceContextTextMapPropagator()
        self._offset = time.time_ns() - now()  # steady clock -> wall clock

    def extract(self, carrier: Mapping[str, str]) -> Any:
        """The client's context from a W3C ``traceparent``, or None."""
        from opentelemetry import trace

        if "traceparent" not in carrier:
            return None
        context = self._propagator.extract(carrier)
        return context if trace.get_current_span(context).get_span_context().is_valid else None

    def export(self, group: TraceGroup) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context

        wall = self._offset
        root = self._tracer.start_span(
            "InferRequest", context=group.carrier, kind=SpanKind.SERVER, start_time=group.started + wall
        )
        for name, ns in group.root.timestamps():
            if name not in _MODEL_EVENTS and name not in _COMPUTE_EVENTS:
                root.add_event(name, timestamp=ns + wall)
        self._model_span(group.root, set_span_in_context(root), SpanKind.SERVER, set_span_in_context)
        root.end(end_time=now() + wall)

    def _model_span(self, trace: Trace, parent: Any, kind: Any, in_context: Any) -> None:
        stamps = trace.timestamps()
        model = [(n, ns) for n, ns in stamps if n in _MODEL_EVENTS]
        if not model:
            return  # tracing without TIMESTAMPS: nothing to show
        wall = self._offset
        attributes: dict[str, Any] = {
            "triton.model_name": trace.model_name,
            "triton.model_version": trace.model_version,
            "triton.trace_id": trace.id,
            "triton.trace_parent_id": trace.parent_id,
        }
        if trace.request_id:
            attributes["triton.request_id"] = trace.request_id
        span = self._tracer.start_span(
            trace.model_name, context=parent, kind=kind, start_time=model[0][1] + wall, attributes=attributes
        )
        for name, ns in model:
            span.add_event(name, timestamp=ns + wall)
        compute = [(n, ns) for n, ns in stamps if n in _COMPUTE_EVENTS]
        context = in_context(span)
        if compute:
            child = self._tracer.start_span("compute", context=context, kind=kind, start_time=compute[0][1] + wall)
            for name, ns in compute:
                child.add_event(name, timestamp=ns + wall)
            child.end(end_time=compute[-1][1] + wall)
        for step in trace.children:
            self._model_span(step, context, kind, in_context)
        span.end(end_time=model[-1][1] + wall)

    def close(self) -> None:
        """Export what is batched and stop (at shutdown)."""
        self._provider.shutdown()
