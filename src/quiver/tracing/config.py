"""The trace flags as ``tritonserver`` parses them: ``--trace-config`` and the older
``--trace-file``, ``--trace-level``, ``--trace-rate``, ``--trace-count`` and
``--trace-log-frequency`` (still accepted, with Triton's deprecation warning).

``--trace-config <mode>,<setting>=<value>`` sets a mode's own setting (``triton,file=...``,
``triton,log-frequency=...``, ``opentelemetry,url=...``, ``opentelemetry,resource=k=v``,
``opentelemetry,bsp_*=...``); ``--trace-config <setting>=<value>`` a global one (``mode``,
``level``, ``rate``, ``count``). As in Triton, levels add up, an explicit ``OFF`` anywhere
turns tracing off, ``--trace-config`` wins over the older flag for the same setting, and the
other mode's settings are ignored.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: Trace levels, as flags (Triton's TRITONSERVER_InferenceTraceLevel bits).
LEVEL_OFF = 0
LEVEL_TIMESTAMPS = 1
LEVEL_TENSORS = 2

MODES = ("triton", "opentelemetry")

#: The OpenTelemetry batch span processor's settings, with Triton's defaults and the
#: environment variables that change the defaults.
BSP_DEFAULTS = (
    ("bsp_max_queue_size", "OTEL_BSP_MAX_QUEUE_SIZE", "2048"),
    ("bsp_schedule_delay", "OTEL_BSP_SCHEDULE_DELAY", "5000"),
    ("bsp_max_export_batch_size", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "512"),
)
DEFAULT_OTEL_URL = "http://localhost:4318/v1/traces"


class TraceConfigError(ValueError):
    """A trace flag that makes no sense; the message names it as Triton's parser does."""


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """The trace settings the server starts with (Triton's defaults)."""

    level: int = LEVEL_OFF
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    file: str = ""
    mode: str = "triton"
    #: The mode's own settings in the order given (opentelemetry: url, resource, bsp_*).
    options: tuple[tuple[str, str], ...] = ()
    #: What Triton prints about deprecated flags; the server logs them at start.
    warnings: tuple[str, ...] = field(default=(), compare=False)


def parse_level(text: str) -> int:
    """One level word, as Triton reads it (case does not matter)."""
    word = text.lower()
    if word in ("false", "off"):
        return LEVEL_OFF
    if word in ("true", "on", "min", "max", "timestamps"):
        return LEVEL_TIMESTAMPS
    if word == "tensors":
        return LEVEL_TENSORS
    raise TraceConfigError(f"invalid value for trace level option: {text}")


def parse_mode(text: str) -> str:
    word = text.lower()
    if word not in MODES:
        raise TraceConfigError(
            f'invalid value for trace mode option: {text}. Available options are "triton" '
            'and "opentelemetry"'
        )
    return word


def split_option(arg: str) -> tuple[str, str, str]:
    """``[mode,]setting=value`` -> (mode or "", setting, value)."""
    comma = arg.find(",")
    equals = arg.find("=", comma + 1)
    mode = ""
    if comma > 0:
        mode = parse_mode(arg[:comma])
    elif comma == 0:
        raise TraceConfigError(
            "No trace mode specified. --trace-config option format is <trace mode>,<setting>=<value> "
            f"or <setting>=<value>. Got {arg}"
        )
    setting = arg[comma + 1 : equals] if equals >= 0 else ""
    value = arg[equals + 1 :] if equals >= 0 else ""
    if not setting or not value:
        raise TraceConfigError(
            f"--trace-config option format is '<trace mode>,<setting>=<value>'. Got {arg}"
        )
    return mode, setting, value


def _int(value: str, flag: str, least: int, most: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise TraceConfigError(f'Bad option: "{flag}".\ninvalid argument: {value}') from None
    if not least <= number <= most:
        raise TraceConfigError(f'Bad option: "{flag}".\n{value} is outside [{least}, {most}]')
    return number


_U32 = (1 << 32) - 1
_I32 = (1 << 31) - 1


def from_flags(
    trace_config: Sequence[str] = (),
    *,
    trace_file: str | None = None,
    trace_level: Sequence[str] = (),
    trace_rate: str | None = None,
    trace_count: str | None = None,
    trace_log_frequency: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> TraceConfig:
    """The trace settings the flags describe; raises TraceConfigError naming a bad one."""
    warnings: list[str] = []
    by_mode: dict[str, list[tuple[str, str]]] = {"": [], "triton": [], "opentelemetry": []}
    for arg in trace_config:
        mode, setting, value = split_option(arg)
        by_mode[mode].append((setting, value))
    level = LEVEL_OFF
    disabled = False
    for word in trace_level:
        warnings.append(
            "'--trace-level' has been deprecated and will be removed in future releases. "
            "Use '--trace-config level=<OFF|TIMESTAMPS|TENSORS>' instead."
        )
        parsed = parse_level(word)
        disabled |= parsed == LEVEL_OFF
        level |= parsed
    rate = 1000
    count = -1
    log_frequency = 0
    file = ""
    if trace_rate is not None:
        warnings.append("'--trace-rate' has been deprecated; use '--trace-config rate=<rate value>' instead.")
        rate = _int(trace_rate, "--trace-rate", 0, _U32)
    if trace_count is not None:
        warnings.append("'--trace-count' has been deprecated; use '--trace-config count=<count value>' instead.")
        count = _int(trace_count, "--trace-count", -1, _I32)
    if trace_log_frequency is not None:
        warnings.append(
            "'--trace-log-frequency' has been deprecated; use "
            "'--trace-config triton,log-frequency=<log frequency value>' instead."
        )
        log_frequency = _int(trace_log_frequency, "--trace-log-frequency", 0, _U32)
    if trace_file is not None:
        warnings.append(
            "'--trace-file' has been deprecated; use '--trace-config triton,file=<filepath>' instead."
        )
        file = trace_file
    mode = "triton"
    for setting, value in by_mode[""]:
        flag = f"--trace-config {setting}"
        if setting == "rate":
            rate = _int(value, flag, 0, _U32)
        elif setting == "level":
            parsed = parse_level(value)
            disabled |= parsed == LEVEL_OFF
            level |= parsed
        elif setting == "mode":
            mode = parse_mode(value)
        elif setting == "count":
            count = _int(value, flag, -1, _I32)
    options: list[tuple[str, str]] = []
    if mode == "triton":
        for setting, value in by_mode["triton"]:
            if setting == "file":
                file = value
            elif setting == "log-frequency":
                log_frequency = _int(value, f"--trace-config triton,{setting}", 0, _U32)
    else:
        if trace_file is not None:
            warnings.append("'--trace-file' is deprecated and will be ignored with opentelemetry tracing mode.")
        if trace_log_frequency is not None:
            warnings.append(
                "'--trace-log-frequency' is deprecated and will be ignored with opentelemetry tracing mode."
            )
        given = {setting for setting, _ in by_mode["opentelemetry"]}
        for setting, value in by_mode["opentelemetry"]:
            if setting.startswith("bsp_"):
                value = str(_int(value, f"--trace-config opentelemetry,{setting}", 0, _U32))
            options.append((setting, value))
        for setting, variable, default in BSP_DEFAULTS:
            if setting not in given:
                value = environ.get(variable, default)
                options.append((setting, str(_int(value, variable, 0, _U32))))
        sizes = dict(options)
        if int(sizes["bsp_max_export_batch_size"]) > int(sizes["bsp_max_queue_size"]):
            raise TraceConfigError(
                "--trace-config opentelemetry,bsp_max_export_batch_size must not be larger than "
                "bsp_max_queue_size"
            )
    if disabled:
        level = LEVEL_OFF
    return TraceConfig(
        level=level,
        rate=rate,
        count=count,
        log_frequency=log_frequency,
        file=file,
        mode=mode,
        options=tuple(options),
        warnings=tuple(warnings),
    )


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The trace flags of ``quiver serve`` (``tritonserver``'s names and formats)."""
    group.add_argument(
        "--trace-config", action="append", default=[], metavar="[MODE,]SETTING=VALUE",
        help="a trace setting, as tritonserver's: global 'mode=triton|opentelemetry', "
        "'level=OFF|TIMESTAMPS|TENSORS' (may repeat), 'rate=N' (trace every N-th request; "
        "default 1000), 'count=N' (-1: no limit); 'triton,file=PATH', "
        "'triton,log-frequency=N' (write every N traces to PATH.<index>); "
        "'opentelemetry,url=URL' (OTLP/HTTP; default http://localhost:4318/v1/traces), "
        "'opentelemetry,resource=KEY=VALUE', 'opentelemetry,bsp_max_queue_size=N', "
        "'opentelemetry,bsp_schedule_delay=MS', 'opentelemetry,bsp_max_export_batch_size=N'",
    )  # fmt: skip
    group.add_argument("--trace-file", default=None, metavar="PATH", help="deprecated: --trace-config triton,file=PATH")
    group.add_argument(
        "--trace-level", action="append", default=[], metavar="LEVEL",
        help="deprecated: --trace-config level=LEVEL",
    )  # fmt: skip
    group.add_argument("--trace-rate", default=None, metavar="N", help="deprecated: --trace-config rate=N")
    group.add_argument("--trace-count", default=None, metavar="N", help="deprecated: --trace-config count=N")
    group.add_argument(
        "--trace-log-frequency", default=None, metavar="N",
        help="deprecated: --trace-config triton,log-frequency=N",
    )  # fmt: skip


def from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> TraceConfig:
    return from_flags(
        args.trace_config,
        trace_file=args.trace_file,
        trace_level=args.trace_level,
        trace_rate=args.trace_rate,
        trace_count=args.trace_count,
        trace_log_frequency=args.trace_log_frequency,
        environ=environ,
    )
