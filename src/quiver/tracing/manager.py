"""The trace settings, global and per model, and which requests are traced.

Triton's rules (``docs/protocol/extension_trace.md``, ``src/tracer.cc``):

- a model without settings of its own uses the global ones; a model's first update copies
  the global values it does not name, and keeps following the global value of every
  setting it never named (or cleared with ``null``);
- clearing a global setting restores the value the server started with;
- every update makes a new setting with fresh counters (the traces the old one still holds
  are written first); ``trace_file`` cannot be changed through the API;
- a setting samples every ``rate``-th request (per setting) while ``count`` is not 0
  (-1: no limit; each trace taken counts it down); an invalid setting (no file in ``triton``
  mode, rate 0) is refused unless it turns tracing off;
- ``triton`` mode collects finished traces and writes them to ``trace_file`` (Triton at
  shutdown or when the setting is replaced; Quiver, when neither a log frequency nor a count
  will send them elsewhere, as they finish: the same file in the end, bounded memory on the
  way), to ``trace_file.<index>`` every ``log_frequency`` traces, and to
  ``trace_file.<index>`` when ``count`` reaches 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from quiver.errors import InvalidArgumentError, UnsupportedError
from quiver.tracing.config import LEVEL_OFF, LEVEL_TENSORS, LEVEL_TIMESTAMPS, TraceConfig
from quiver.tracing.file import TraceFiles
from quiver.tracing.trace import Trace, TraceGroup

_FIELDS = ("level", "rate", "count", "log_frequency")
_U32 = (1 << 32) - 1
_I32 = (1 << 31) - 1


class TraceSetting:
    """One set of values (global or a model's), with its sampling counters and the traces
    it collected and has not written yet."""

    def __init__(
        self,
        manager: TraceManager,
        values: dict[str, Any],
        specified: frozenset[str] = frozenset(),
    ) -> None:
        self.manager = manager
        self.level: int = values["level"]
        self.rate: int = values["rate"]
        self.count: int = values["count"]
        self.log_frequency: int = values["log_frequency"]
        self.file: str = values["file"]
        self.mode: str = values["mode"]
        self.specified = specified
        self.reason = ""
        if self.level == LEVEL_OFF:
            self.reason = "tracing is disabled"
        elif self.rate == 0:
            self.reason = "sample rate must be non-zero"
        elif self.mode == "triton" and not self.file:
            self.reason = "trace file name is not given"
        self._sampled = 0  # requests seen (Triton's sample_)
        self._created = 0  # traces taken under a count
        self._collected = 0
        self._held: list[bytes] = []  # finished traces not written yet
        self._closed = False  # replaced: traces still in flight are written as they finish

    def values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in (*_FIELDS, "file", "mode")}

    def valid(self) -> bool:
        return not self.reason and self.count != 0

    def sample(self, force: bool = False) -> bool:
        """Whether to trace the next request (``force``: the client asked, OpenTelemetry)."""
        hit = False
        if self.rate != 0:
            if not self.valid() and not force:
                return False
            self._sampled += 1
            hit = self._sampled % self.rate == 0
            if hit and self.count > 0:
                self.count -= 1
                self._created += 1
            elif hit and self.count == 0:
                hit = False
        return hit or force

    def collect(self, group: TraceGroup) -> None:
        """A finished trace (``triton`` mode): written now, or held for an indexed file."""
        traces = group.to_json()
        self._collected += 1
        files = self.manager.files
        if self.log_frequency == 0 and self.count < 0 and not self._held:
            files.append(self.file, traces)  # where Triton writes it at shutdown
            return
        if traces:
            self._held.append(traces)
        if (self.count == 0 and self._collected >= self._created) or (
            self.log_frequency and len(self._held) >= self.log_frequency
        ):
            held, self._held = self._held, []
            files.write_indexed(self.file, b",".join(held))
        elif self._closed:
            self.close()

    def close(self) -> None:
        """The setting is replaced or the server stops: write what it still holds."""
        self._closed = True
        held, self._held = self._held, []
        if held and self.mode == "triton":
            if self.log_frequency:
                self.manager.files.write_indexed(self.file, b",".join(held))
            else:
                self.manager.files.append(self.file, b",".join(held))


class TraceManager:
    """Every trace setting of one server and the sampling of requests."""

    def __init__(self, config: TraceConfig | None = None, exporter: Any = None) -> None:
        config = config or TraceConfig()
        self.config = config
        self.files = TraceFiles()
        #: OpenTelemetry mode: turns a released group into spans (quiver.tracing.otel).
        self.exporter = exporter
        start = {
            "level": config.level,
            "rate": config.rate,
            "count": config.count,
            "log_frequency": config.log_frequency,
            "file": config.file,
            "mode": config.mode,
        }
        self._default = TraceSetting(self, start)
        self._global = TraceSetting(self, start)
        self._models: dict[str, TraceSetting] = {}
        self._fallback: set[str] = set()  # models with settings that follow some global values
        #: Whether any setting traces (else no request is sampled: the frontends skip asking).
        self.active = self._any_active()

    # -- the settings API ------------------------------------------------------------------

    def setting(self, model: str = "") -> TraceSetting:
        return self._models.get(model, self._global) if model else self._global

    def settings_json(self, model: str = "") -> dict[str, Any]:
        """Triton's trace setting response: every value as text, ``trace_level`` a list."""
        setting = self.setting(model)
        levels = []
        if setting.level & LEVEL_TIMESTAMPS:
            levels.append("TIMESTAMPS")
        if setting.level & LEVEL_TENSORS:
            levels.append("TENSORS")
        out: dict[str, Any] = {
            "trace_level": levels or ["OFF"],
            "trace_rate": str(setting.rate),
            "trace_count": str(setting.count),
        }
        if setting.mode == "triton":
            out["log_frequency"] = str(setting.log_frequency)
            out["trace_file"] = setting.file
        out["trace_mode"] = setting.mode
        if setting.mode != "triton":
            for key, value in self.config.options:
                out[key] = value
        return out

    def update(self, model: str, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Apply a trace setting request (values as text or lists of text, None to clear);
        returns the settings after it. Errors carry Triton's messages."""
        if "trace_file" in changes:
            raise UnsupportedError("trace file location can not be updated through network protocol")
        new: dict[str, Any] = {}
        cleared: set[str] = set()
        if "trace_level" in changes:
            value = changes["trace_level"]
            if value is None or value == []:
                cleared.add("level")
            else:
                level = _level(value)
                if level is not None:
                    new["level"] = level
        for key, field, least, most in (
            ("trace_rate", "rate", 0, _U32),
            ("trace_count", "count", -1, _I32),
            ("log_frequency", "log_frequency", 0, _U32),
        ):
            if key in changes:
                value = changes[key]
                if value is None or value == []:
                    cleared.add(field)
                else:
                    new[field] = _number(key, value, least, most)
        self._update(model, new, cleared)
        if not model:
            for name in sorted(self._fallback):
                self._update(name, {}, set())
        self.active = self._any_active()
        return self.settings_json(model)

    def _update(self, model: str, new: dict[str, Any], cleared: set[str]) -> None:
        if model:
            current = self._models.get(model)
            fallback = self._global
        else:
            current = self._global
            fallback = self._default
        values = fallback.values()
        specified = set()
        for field in _FIELDS:
            if field in cleared:
                continue
            if field in new:
                values[field] = new[field]
                specified.add(field)
            elif current is not None and field in current.specified:
                values[field] = getattr(current, field)
                specified.add(field)
        setting = TraceSetting(self, values, frozenset(specified))
        if not setting.valid() and setting.reason and setting.level != LEVEL_OFF:
            raise InvalidArgumentError(f"Attempting to set invalid trace setting :{setting.reason}")
        if model and not specified:
            self._fallback.discard(model)
            old = self._models.pop(model, None)
        elif model:
            self._fallback.add(model)  # trace_file is never a model's own: never all specified
            old = self._models.get(model)
            self._models[model] = setting
        else:
            old = self._global
            self._global = setting
        if old is not None:
            old.close()

    def _any_active(self) -> bool:
        return self._global.level != LEVEL_OFF or any(s.level != LEVEL_OFF for s in self._models.values())

    # -- sampling --------------------------------------------------------------------------

    def sample(self, model: str, carrier: Callable[[], Mapping[str, str]] | None = None) -> Trace | None:
        """The trace for a request to ``model``, or None if it is not traced. ``carrier()``:
        the request's headers (OpenTelemetry mode: a propagated ``traceparent`` forces a
        trace)."""
        if not self.active:
            return None
        setting = self._models.get(model, self._global)
        if setting.level == LEVEL_OFF:
            return None
        context = None
        if setting.mode == "opentelemetry" and self.exporter is not None and carrier is not None:
            context = self.exporter.extract(carrier())
        if not setting.sample(force=context is not None):
            return None
        sink: Callable[[TraceGroup], None]
        if setting.mode == "opentelemetry":
            if self.exporter is None:
                return None
            sink = self.exporter.export
        else:
            sink = setting.collect
        return TraceGroup(setting.level, setting, sink, context).root

    def close(self) -> None:
        """At shutdown: write what every setting holds, flush the exporter."""
        for setting in (self._global, *self._models.values()):
            setting.close()
        self.files.close()
        if self.exporter is not None:
            self.exporter.close()


def _level(value: Any) -> int | None:
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise InvalidArgumentError("'trace_level' must be a list of strings")
    level: int | None = None
    for word in words:
        if word == "OFF":
            if len(words) != 1:
                raise InvalidArgumentError("Expect only one trace level 'OFF' is specified")
            level = LEVEL_OFF
        elif word == "TIMESTAMPS":
            level = (level or 0) | LEVEL_TIMESTAMPS
        elif word == "TENSORS":
            level = (level or 0) | LEVEL_TENSORS
    return level  # other words are ignored, as Triton ignores them


def _number(key: str, value: Any, least: int, most: int) -> int:
    if isinstance(value, list):
        if len(value) != 1:
            raise InvalidArgumentError(f"expect only 1 value for '{key}'")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InvalidArgumentError(f"Unable to parse '{key}', got: {value}")
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgumentError(f"Unable to parse '{key}', got: {value}") from None
    if not least <= number <= most:
        raise InvalidArgumentError(
            f"Unable to parse '{key}', value is out of range [ {least}, {most} ], got: {value}"
        )
    return number
