"""Parse config.pbtxt into Triton's ModelConfig message and wrap it in typed objects.

The message class is the one ``tritonclient`` ships (``model_config_pb2``), so the text
format, field names and enum values are exactly Triton's. Validation errors name the file
and the field that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2 as pb

from quiver.errors import ConfigError
from quiver.types import DataType

#: platform -> backend, as Triton resolves them.
PLATFORM_BACKEND = {
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "tensorflow_graphdef": "tensorflow",
    "tensorflow_savedmodel": "tensorflow",
    "tensorrt_plan": "tensorrt",
    "ensemble": "ensemble",
}
#: backend -> platform, where the backend has one (tensorflow's depends on the model file).
BACKEND_PLATFORM = {
    "onnxruntime": "onnxruntime_onnx",
    "pytorch": "pytorch_libtorch",
    "tensorrt": "tensorrt_plan",
}
#: backend -> the file Triton looks for in a version folder when none is configured.
DEFAULT_MODEL_FILENAME = {
    "onnxruntime": "model.onnx",
    "pytorch": "model.pt",
    "python": "model.py",
    "tensorrt": "model.plan",
    "dali": "model.dali",
}
#: tensorflow's default file depends on the platform.
PLATFORM_MODEL_FILENAME = {
    "tensorflow_graphdef": "model.graphdef",
    "tensorflow_savedmodel": "model.savedmodel",
}

_KIND_NAMES = {
    pb.ModelInstanceGroup.KIND_AUTO: "KIND_AUTO",
    pb.ModelInstanceGroup.KIND_CPU: "KIND_CPU",
    pb.ModelInstanceGroup.KIND_GPU: "KIND_GPU",
    pb.ModelInstanceGroup.KIND_MODEL: "KIND_MODEL",
}


@dataclass(frozen=True, slots=True)
class TensorConfig:
    """One ``input`` or ``output`` entry. ``dims`` excludes the batch dimension."""

    name: str
    datatype: DataType
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    optional: bool = False
    label_filename: str = ""
    is_shape_tensor: bool = False

    def full_shape(self, max_batch_size: int) -> list[int]:
        """The shape clients see in metadata: ``[-1, *dims]`` when the model batches."""
        return [-1, *self.dims] if max_batch_size > 0 else list(self.dims)


@dataclass(frozen=True, slots=True)
class InstanceGroup:
    name: str
    count: int
    kind: str  # KIND_CPU, KIND_GPU, KIND_AUTO, KIND_MODEL
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    """``latest`` (with ``num_versions``), ``all`` or ``specific`` (with ``versions``)."""

    kind: str = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve out of those present on disk, ascending."""
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[-self.num_versions :] if self.num_versions > 0 else []


@dataclass(slots=True)
class ModelConfig:
    """A validated model configuration; ``proto`` is the underlying Triton message."""

    proto: pb.ModelConfig
    source: str = "<config>"
    inputs: list[TensorConfig] = field(default_factory=list)
    outputs: list[TensorConfig] = field(default_factory=list)
    instance_groups: list[InstanceGroup] = field(default_factory=list)
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    parameters: dict[str, str] = field(default_factory=dict)
    input_map: dict[str, TensorConfig] = field(default_factory=dict)
    output_map: dict[str, TensorConfig] = field(default_factory=dict)
    #: ``proto.name`` and ``proto.max_batch_size``, read once (every request reads them;
    #: reading the message costs more than a plain attribute).
    name: str = field(init=False)
    max_batch_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.input_map = {t.name: t for t in self.inputs}
        self.output_map = {t.name: t for t in self.outputs}
        self.name = str(self.proto.name)
        self.max_batch_size = int(self.proto.max_batch_size)

    @property
    def platform(self) -> str:
        return str(self.proto.platform)

    @property
    def backend(self) -> str:
        return str(self.proto.backend)

    @property
    def default_model_filename(self) -> str:
        return (
            self.proto.default_model_filename
            or PLATFORM_MODEL_FILENAME.get(self.platform)
            or DEFAULT_MODEL_FILENAME.get(self.backend, "")
        )

    def input(self, name: str) -> TensorConfig | None:
        return self.input_map.get(name)

    def output(self, name: str) -> TensorConfig | None:
        return self.output_map.get(name)

    def to_json(self) -> dict[str, Any]:
        return config_to_json(self.proto)

    @classmethod
    def from_proto(cls, proto: pb.ModelConfig, source: str = "<config>") -> ModelConfig:
        """Resolve defaults (backend from platform, instance groups) and validate."""
        resolve_backend(proto, source)
        return _build(proto, source)


def parse_model_config(
    text: str, source: str | Path, model_name: str, *, name_must_match: bool = True
) -> pb.ModelConfig:
    """Parse config.pbtxt text into the ModelConfig message (not yet validated).

    With ``name_must_match`` false (models from archives, served under the archive's key
    or a namespaced name), the config's ``name`` is replaced by ``model_name``."""
    proto = pb.ModelConfig()
    try:
        text_format.Parse(text, proto)
    except text_format.ParseError as exc:
        raise ConfigError(f"{source}: invalid model configuration: {exc}") from None
    _check_name(proto, source, model_name, must_match=name_must_match)
    return proto


def parse_model_config_json(text: str | bytes, source: str, model_name: str) -> pb.ModelConfig:
    """Parse a config given as JSON (the repository API's ``config`` parameter)."""
    proto = pb.ModelConfig()
    try:
        json_format.Parse(text, proto)
    except json_format.ParseError as exc:
        raise ConfigError(f"{source}: invalid model configuration: {exc}") from None
    _check_name(proto, source, model_name)
    return proto


def _check_name(
    proto: pb.ModelConfig, source: str | Path, model_name: str, *, must_match: bool = True
) -> None:
    # File names first: auto-complete opens the model file before full validation runs.
    _check_relative(proto.default_model_filename, "default_model_filename", str(source))
    for output in proto.output:
        _check_relative(output.label_filename, "label_filename", f"{source}: output '{output.name}'")
    if not proto.name or not must_match:
        proto.name = model_name
    elif proto.name != model_name:
        raise ConfigError(
            f"{source}: field 'name': configuration names model '{proto.name}' but it "
            f"lives in folder '{model_name}'"
        )


def resolve_backend(proto: pb.ModelConfig, source: str | Path) -> None:
    """Fill ``backend`` from ``platform`` and the reverse, as Triton does."""
    if proto.platform and not proto.backend:
        backend = PLATFORM_BACKEND.get(proto.platform)
        if backend is None:
            raise ConfigError(
                f"{source}: field 'platform': unsupported platform '{proto.platform}' "
                f"(known: {', '.join(sorted(PLATFORM_BACKEND))})"
            )
        if backend != "ensemble":
            proto.backend = backend
    elif proto.backend and not proto.platform:
        platform = BACKEND_PLATFORM.get(proto.backend)
        if platform:
            proto.platform = platform


def _build(proto: pb.ModelConfig, source: str) -> ModelConfig:
    where = f"{source}"
    if not proto.backend and proto.platform != "ensemble":
        raise ConfigError(f"{where}: model '{proto.name}' sets neither 'backend' nor 'platform'")
    if proto.max_batch_size < 0:
        raise ConfigError(f"{where}: field 'max_batch_size' must be >= 0, got {proto.max_batch_size}")

    if proto.response_cache.enable:  # Triton's checks, whether the server has a cache or not
        kind = ""
        if proto.HasField("sequence_batching"):
            kind = "with sequence batching scheduler"
        elif proto.model_transaction_policy.decoupled:
            kind = "with 'decoupled' transaction policy"
        if kind:
            raise ConfigError(
                f"{where}: Response Cache does not currently support model {proto.name} {kind}. "
                "Please disable the response cache."
            )
    _check_relative(proto.default_model_filename, "default_model_filename", where)
    inputs = [_tensor(t, "input", where, is_input=True) for t in proto.input]
    outputs = [_tensor(t, "output", where, is_input=False) for t in proto.output]
    for kind, tensors in (("input", inputs), ("output", outputs)):
        seen: set[str] = set()
        for tensor in tensors:
            if tensor.name in seen:
                raise ConfigError(f"{where}: {kind} '{tensor.name}' is declared twice")
            seen.add(tensor.name)

    groups: list[InstanceGroup] = []
    if not proto.instance_group:
        proto.instance_group.add(count=1, kind=pb.ModelInstanceGroup.KIND_CPU)
    for index, group in enumerate(proto.instance_group):
        if not group.name:
            group.name = f"{proto.name}_{index}"
        if group.count == 0:  # Triton's default
            group.count = 1
        if group.count < 1:
            raise ConfigError(
                f"{where}: field 'instance_group[{index}].count' must be >= 1, got {group.count}"
            )
        if group.kind == pb.ModelInstanceGroup.KIND_AUTO:
            group.kind = pb.ModelInstanceGroup.KIND_CPU
        groups.append(
            InstanceGroup(
                name=group.name,
                count=group.count,
                kind=_KIND_NAMES[group.kind],
                gpus=tuple(group.gpus),
            )
        )

    policy = proto.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        version_policy = VersionPolicy(kind="all")
    elif which == "specific":
        if any(v < 0 for v in policy.specific.versions):
            raise ConfigError(f"{where}: field 'version_policy.specific.versions' must be >= 0")
        version_policy = VersionPolicy(kind="specific", versions=tuple(policy.specific.versions))
    else:
        num = policy.latest.num_versions if which == "latest" else 1
        if num < 1:
            raise ConfigError(
                f"{where}: field 'version_policy.latest.num_versions' must be >= 1, got {num}"
            )
        version_policy = VersionPolicy(kind="latest", num_versions=num)

    parameters = {key: value.string_value for key, value in proto.parameters.items()}
    return ModelConfig(
        proto=proto,
        source=source,
        inputs=inputs,
        outputs=outputs,
        instance_groups=groups,
        version_policy=version_policy,
        parameters=parameters,
    )


def _relative(name: str, field_name: str, where: str) -> str:
    _check_relative(name, field_name, where)
    return name


def _check_relative(name: str, field_name: str, where: str) -> None:
    """File names in a config are relative to the model's folder and stay inside it."""
    if not name:
        return
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if PurePosixPath(name).is_absolute() or name.startswith(("/", "\\")) or ".." in parts or "\0" in name:
        raise ConfigError(
            f"{where}: field '{field_name}' must name a file inside the model's folder, got '{name}'"
        )


def _tensor(t: pb.ModelInput | pb.ModelOutput, kind: str, where: str, *, is_input: bool) -> TensorConfig:
    if not t.name:
        raise ConfigError(f"{where}: an {kind} has no 'name'")
    if t.data_type == pb.TYPE_INVALID:
        raise ConfigError(f"{where}: {kind} '{t.name}': field 'data_type' is missing or TYPE_INVALID")
    for dim in t.dims:
        if dim == 0 or dim < -1:
            raise ConfigError(
                f"{where}: {kind} '{t.name}': field 'dims' has {dim}; each dimension must be "
                ">= 1, or -1 for a variable size"
            )
    reshape = tuple(t.reshape.shape) if t.HasField("reshape") else None
    return TensorConfig(
        name=t.name,
        datatype=DataType.from_config(pb.DataType.Name(t.data_type)),
        dims=tuple(t.dims),
        reshape=reshape,
        optional=bool(getattr(t, "optional", False)) if is_input else False,
        label_filename="" if is_input else _relative(t.label_filename, "label_filename", f"{where}: {kind} '{t.name}'"),
        is_shape_tensor=t.is_shape_tensor,
    )


def config_to_json(proto: Message) -> dict[str, Any]:
    """Triton's JSON form of a config: proto field names, every field, int64 as numbers."""
    data: dict[str, Any] = json_format.MessageToDict(
        proto,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    _int64_to_numbers(proto.DESCRIPTOR, data)
    return data


_INT64_TYPES = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def _int64_to_numbers(descriptor: Any, data: dict[str, Any]) -> None:
    for fd in descriptor.fields:
        if fd.name not in data:
            continue
        value = data[fd.name]
        if fd.type in _INT64_TYPES:
            if isinstance(value, list):
                data[fd.name] = [int(v) for v in value]
            else:
                data[fd.name] = int(value)
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            sub = fd.message_type
            if sub.GetOptions().map_entry:
                value_fd = sub.fields_by_name["value"]
                if value_fd.type == FieldDescriptor.TYPE_MESSAGE:
                    for item in value.values():
                        _int64_to_numbers(value_fd.message_type, item)
                elif value_fd.type in _INT64_TYPES:
                    data[fd.name] = {k: int(v) for k, v in value.items()}
            elif isinstance(value, list):
                for item in value:
                    _int64_to_numbers(sub, item)
            elif isinstance(value, dict):
                _int64_to_numbers(sub, value)
