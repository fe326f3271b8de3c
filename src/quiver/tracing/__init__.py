"""Triton's trace extension: the trace settings (global and per model, through HTTP and
gRPC), request traces in Triton's JSON trace file (``triton`` mode) or as OpenTelemetry spans
(``opentelemetry`` mode), and the ``--trace-config`` flags.

- :mod:`~quiver.tracing.config`: the flags, parsed as ``tritonserver`` parses them;
- :mod:`~quiver.tracing.manager`: the settings and which requests are traced;
- :mod:`~quiver.tracing.trace`: one sampled request's activities and their JSON;
- :mod:`~quiver.tracing.file`: the trace files, written off the event loop;
- :mod:`~quiver.tracing.otel`: the OpenTelemetry spans and their OTLP/HTTP export.
"""

from quiver.tracing.config import TraceConfig, TraceConfigError
from quiver.tracing.manager import TraceManager
from quiver.tracing.trace import Trace

__all__ = ["Trace", "TraceConfig", "TraceConfigError", "TraceManager"]
