"""How one model is loaded: config, auto-complete, version policy, instances, labels.

Everything here blocks (file reads, framework sessions, user ``initialize`` code) and runs
on the manager's load threads, never on the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import (
    INLINE_THRESHOLD_NS,
    Backend,
    ModelFiles,
    ModelInstance,
    ThreadedInstance,
    get_backend,
    imported_backend,
    instance_specs,
)
from quiver.config import ModelConfig, parse_model_config
from quiver.config.model_config import resolve_backend
from quiver.ensemble.plan import EnsemblePlan, build_plan
from quiver.ensemble.scheduler import EnsembleScheduler, InferFn
from quiver.errors import ConfigError, QuiverError
from quiver.lifecycle.clock import SYSTEM_CLOCK, Clock, seconds
from quiver.lifecycle.configs import ConfigCache, PreparedConfig
from quiver.lifecycle.memory import release_free_memory
from quiver.lifecycle.model import Model
from quiver.lifecycle.warmup import build_warmup_samples, run_warmup
from quiver.metrics.statistics import ModelStatistics
from quiver.repository.local import ModelSource
from quiver.scheduling import create_scheduler

logger = logging.getLogger(__name__)

#: Files that name their backend when a model comes without a config.pbtxt.
_FILE_BACKENDS = {
    "model.onnx": "onnxruntime",
    "model.py": "python",
    "model.pt": "pytorch",
    "model.graphdef": "tensorflow",
    "model.savedmodel": "tensorflow",
    "model.plan": "tensorrt",
}


@dataclass(slots=True)
class LoadOutcome:
    """What loading one model gave: READY versions and per-version failures."""

    config: ModelConfig | None
    models: list[Model]
    failures: dict[int, str]  # version -> reason
    error: str = ""  # a failure of the whole model (config, no versions)


def read_config(
    source: ModelSource, *, strict: bool, override: pb.ModelConfig | None = None
) -> tuple[pb.ModelConfig, Backend | None]:
    """The model's configuration as written (or as overridden), backend and platform resolved."""
    proto = read_proto(source, strict=strict, override=override)
    backend = get_backend(proto.backend) if proto.backend else None
    return proto, backend


def read_proto(
    source: ModelSource,
    *,
    strict: bool,
    override: pb.ModelConfig | None = None,
    configs: ConfigCache | None = None,
    fingerprint: str = "",
) -> pb.ModelConfig:
    """:func:`read_config` without the backend: the framework is not imported. With
    ``configs`` and the files' ``fingerprint`` (and no override), read once per fingerprint:
    the proto returned is then shared, not to be changed."""
    cached = configs is not None and bool(fingerprint) and override is None
    if cached:
        assert configs is not None
        found = configs.read(source, fingerprint, strict)
        if found is not None:
            return found
        proto = _read_proto(source, strict=strict, override=None)
        configs.remember_read(source, fingerprint, strict, proto)
        return proto
    return _read_proto(source, strict=strict, override=override)


def _read_proto(source: ModelSource, *, strict: bool, override: pb.ModelConfig | None) -> pb.ModelConfig:
    path = source.config_path
    if override is not None:
        proto = pb.ModelConfig()
        proto.CopyFrom(override)
    elif path.exists():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read model configuration: {exc}") from None
        proto = parse_model_config(text, path, source.name, name_must_match=not source.archive)
    elif strict:
        raise ConfigError(
            f"model '{source.name}': {path} does not exist, and --strict-model-config is set"
        )
    else:
        proto = pb.ModelConfig(name=source.name)
    if source.archive:
        proto.name = source.name
    if source.aliases:
        # An archive is a namespace: its ensembles' steps name models of the same archive,
        # which are served under namespaced names.
        aliases = dict(source.aliases)
        for step in proto.ensemble_scheduling.step:
            step.model_name = aliases.get(step.model_name, step.model_name)
    resolve_backend(proto, path)
    if not proto.backend and proto.platform != "ensemble":
        _guess_backend(proto, source)
    return proto


def _guess_backend(proto: pb.ModelConfig, source: ModelSource) -> None:
    """Triton infers the backend of a config-less model from its model file's name."""
    if proto.default_model_filename:
        suffix = Path(proto.default_model_filename).suffix
        candidates = [n for n in _FILE_BACKENDS if Path(n).suffix == suffix]
    else:
        candidates = list(_FILE_BACKENDS)
    filename = proto.default_model_filename
    for version in reversed(source.versions()):
        folder = source.path / str(version)
        for candidate in candidates:
            if (folder / (filename or candidate)).exists():
                proto.backend = _FILE_BACKENDS[candidate]
                resolve_backend(proto, source.config_path)
                return
    raise ConfigError(
        f"model '{source.name}': {source.config_path} sets neither 'backend' nor 'platform', "
        f"and no version folder holds one of {', '.join(_FILE_BACKENDS)} to infer it from"
    )


def load_model(
    source: ModelSource,
    *,
    strict: bool,
    inline_threshold_ns: int = INLINE_THRESHOLD_NS,
    config_override: pb.ModelConfig | None = None,
    clock: Clock = SYSTEM_CLOCK,
    configs: ConfigCache | None = None,
    fingerprint: str = "",
    announce: bool = True,
) -> LoadOutcome:
    """Load every version the version policy selects; failures are reported, not raised.
    With ``configs`` and the files' ``fingerprint``, the configuration is prepared (read,
    auto-completed, validated, labels read) once per fingerprint. ``announce``: log what
    loaded (a load under the memory budget is announced once its size is known, in one line
    with it)."""
    started = seconds(clock)
    try:
        prepared = _prepare(source, strict, config_override, configs, fingerprint)
        config, labels = prepared.config, prepared.labels
        backend = get_backend(prepared.proto.backend)
        selected = config.version_policy.select(list(prepared.versions))
        if not selected:
            raise ConfigError(
                f"model '{source.name}': version policy selects none of the versions on disk "
                f"({', '.join(map(str, prepared.versions)) or 'none'})"
            )
    except QuiverError as exc:
        logger.error("failed to load model '%s': %s", source.name, exc)
        return LoadOutcome(None, [], {}, str(exc))
    except Exception as exc:  # a bug must cost one model, not the server
        logger.exception("failed to load model '%s'", source.name)
        return LoadOutcome(None, [], {}, f"model '{source.name}': {type(exc).__name__}: {exc}")

    models: list[Model] = []
    failures: dict[int, str] = {}
    for version in selected:
        try:
            models.append(_load_version(config, backend, source, version, labels, inline_threshold_ns, clock))
        except QuiverError as exc:
            failures[version] = str(exc)
            logger.error("failed to load model '%s' version %d: %s", source.name, version, exc)
        except Exception as exc:  # a backend bug must not take the server down
            logger.exception("failed to load model '%s' version %d", source.name, version)
            failures[version] = f"model '{source.name}' version {version}: {type(exc).__name__}: {exc}"
    elapsed = seconds(clock) - started
    for model in models:
        model.load_seconds = elapsed
    if models and announce:
        logger.info(
            "loaded model '%s' version(s) %s in %.3f s",
            source.name,
            ", ".join(m.version_str for m in models),
            elapsed,
        )
    return LoadOutcome(config, models, failures)


def prepare_ahead(
    source: ModelSource,
    strict: bool,
    configs: ConfigCache,
    fingerprint: str,
    proceed: Callable[[], bool] | None = None,
) -> bool:
    """Blocking: ``source``'s configuration prepared into ``configs`` (read, auto-completed,
    validated, labels and version folders read: what :func:`load_model` starts with) when
    that needs neither a framework import nor the model's files: its backend has been
    imported and says its auto-complete leaves the configuration as it is
    (``completes_without_files``; a backend without that says nothing and is not prepared
    ahead). ``proceed``: asked once the configuration is read; when it says no, it is only
    read. Whether it was prepared; QuiverError when the configuration is wrong."""
    proto = read_proto(source, strict=strict, configs=configs, fingerprint=fingerprint)
    backend = imported_backend(proto.backend) if proto.backend else None
    completes = getattr(backend, "completes_without_files", None)
    if completes is None or not completes(proto, strict):
        return False
    if proceed is not None and not proceed():
        return False
    _prepare(source, strict, None, configs, fingerprint)
    return True


def _prepare(
    source: ModelSource,
    strict: bool,
    override: pb.ModelConfig | None,
    configs: ConfigCache | None,
    fingerprint: str,
) -> PreparedConfig:
    """The configuration to load ``source`` with: from ``configs`` when these files were
    prepared before, else read, completed and validated (and remembered)."""
    cached = configs is not None and bool(fingerprint) and override is None
    if cached:
        assert configs is not None
        found = configs.prepared(source, fingerprint, strict)
        if found is not None:
            return found
    read = read_proto(source, strict=strict, override=override, configs=configs, fingerprint=fingerprint)
    proto = pb.ModelConfig()
    proto.CopyFrom(read)  # auto-complete writes to it; the one read may be shared
    backend = get_backend(proto.backend) if proto.backend else None
    versions = source.versions()
    if not versions:
        raise ConfigError(f"model '{source.name}': no version folder in {source.path}")
    if backend is None:
        raise ConfigError(f"model '{source.name}': platform '{proto.platform}' is not supported yet")
    backend.auto_complete(proto, ModelFiles(source.repository, source.path, versions[-1]), strict)
    config = ModelConfig.from_proto(proto, str(source.config_path))
    prepared = PreparedConfig(proto, config, _read_labels(config, source.path), tuple(versions))
    if cached:
        assert configs is not None
        configs.remember_prepared(source, fingerprint, strict, prepared)
    return prepared


def _load_version(
    config: ModelConfig,
    backend: Backend,
    source: ModelSource,
    version: int,
    labels: dict[str, list[str]],
    inline_threshold_ns: int,
    clock: Clock,
) -> Model:
    files = ModelFiles(source.repository, source.path, version)
    samples = build_warmup_samples(config, source.path)  # validated before any instance exists
    instances: list[ModelInstance] = []
    try:
        for spec in instance_specs(config):
            cpu = time.thread_time_ns()  # the creation's own work: a busy machine stretches wall time
            instance = backend.create_instance(config, files, spec)
            if isinstance(instance, ThreadedInstance):
                instance.inline_threshold_ns = inline_threshold_ns
                instance.created_in(time.thread_time_ns() - cpu)
            instances.append(instance)
        run_warmup(config, version, instances, samples, clock=clock)
    except BaseException:
        for instance in instances:
            unload_instance(config.name, instance)
        raise
    stats = ModelStatistics()
    try:
        scheduler = create_scheduler(config, instances, stats, version_dir=files.version_dir)
    except BaseException:
        for instance in instances:
            unload_instance(config.name, instance)
        raise
    return Model(source.name, version, config, scheduler, instances, labels, stats)


def _read_labels(config: ModelConfig, model_dir: Path) -> dict[str, list[str]]:
    labels: dict[str, list[str]] = {}
    for output in config.outputs:
        if not output.label_filename:
            continue
        path = model_dir / output.label_filename
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"{config.source}: output '{output.name}': cannot read label_filename "
                f"'{output.label_filename}': {exc}"
            ) from None
        labels[output.name] = parse_labels(raw)
    return labels


def parse_labels(raw: bytes) -> list[str]:
    """A label file's labels, one per line, as Triton reads them (line ``i`` is class ``i``;
    lines end at ``\n`` only, so no other character shifts the classes), and whatever the
    file's form: Windows line endings (``\r\n``) and old Mac ones (``\r`` alone, when the
    file has no ``\n``), a UTF-8 byte-order mark, UTF-16 with its mark, or bytes that are
    not UTF-8 (read as Latin-1). An empty line is a class without a label."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        text = raw.decode("utf-16")
    else:
        raw = raw.removeprefix(b"\xef\xbb\xbf")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
    if "\n" not in text and "\r" in text:
        text = text.replace("\r", "\n")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    return [line.removesuffix("\r") for line in lines]


def _ensemble_labels(
    config: ModelConfig, plan: EnsemblePlan, composing: dict[str, ModelConfig]
) -> dict[str, list[str]]:
    """Labels for an ensemble's outputs that have no label file of their own: those of the
    composing model's output that produces it, as Triton completes an ensemble's labels."""
    labels: dict[str, list[str]] = {}
    for output in config.outputs:
        if output.label_filename:
            continue
        for step in plan.steps:
            for model_output, tensor in step.output_map:
                if tensor != output.name:
                    continue
                model = composing.get(step.model_name)
                spec = model.output(model_output) if model is not None else None
                if model is None or spec is None or not spec.label_filename:
                    continue
                try:
                    found = _read_labels(model, Path(model.source).parent)
                except ConfigError:
                    continue  # the composing model loaded without them: nothing to inherit
                if model_output in found:
                    labels[output.name] = found[model_output]
    return labels


def backend_name(
    source: ModelSource,
    *,
    strict: bool,
    override: pb.ModelConfig | None = None,
    configs: ConfigCache | None = None,
    fingerprint: str = "",
) -> str:
    """The backend the model's config names (``onnxruntime``, ``pytorch``, ``python``...),
    without importing it; ``""`` when the config does not say or cannot be read (the load
    reports why)."""
    try:
        proto = read_proto(source, strict=strict, override=override, configs=configs, fingerprint=fingerprint)
        return str(proto.backend)
    except QuiverError:
        return ""


def load_ensemble(
    source: ModelSource,
    *,
    strict: bool,
    composing: dict[str, ModelConfig],
    infer: InferFn,
    config_override: pb.ModelConfig | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> LoadOutcome:
    """Load an ensemble whose composing models are READY (their configs in ``composing``)."""
    started = seconds(clock)
    try:
        proto, _ = read_config(source, strict=strict, override=config_override)
        versions = source.versions()
        if not versions:
            raise ConfigError(f"model '{source.name}': no version folder in {source.path}")
        config = ModelConfig.from_proto(proto, str(source.config_path))
        plan = build_plan(config, composing)
        selected = config.version_policy.select(versions)
        if not selected:
            raise ConfigError(
                f"model '{source.name}': version policy selects none of the versions on disk"
            )
        labels = {**_ensemble_labels(config, plan, composing), **_read_labels(config, source.path)}
    except QuiverError as exc:
        logger.error("failed to load ensemble '%s': %s", source.name, exc)
        return LoadOutcome(None, [], {}, str(exc))
    models = []
    elapsed = seconds(clock) - started
    for version in selected:
        stats = ModelStatistics()
        scheduler = EnsembleScheduler(plan, infer, stats, batching=config.max_batch_size > 0)
        model = Model(source.name, version, config, scheduler, [], labels, stats)
        model.load_seconds = elapsed
        models.append(model)
    logger.info(
        "loaded ensemble '%s' (%s) in %.3f s", source.name, ", ".join(plan.composing_models), elapsed
    )
    return LoadOutcome(config, models, {})


def unload_instance(model: str, instance: ModelInstance) -> None:
    try:
        instance.unload()
    except Exception:
        logger.exception("model '%s': instance %s failed to unload cleanly", model, instance.name)


def unload_instances(instances: list[tuple[str, ModelInstance]], *, trim: bool) -> None:
    """Blocking: unload each (model name, instance), then give the freed heap back if ``trim``."""
    for name, instance in instances:
        unload_instance(name, instance)
    if trim:
        release_free_memory()
