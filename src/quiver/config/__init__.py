"""config.pbtxt <-> typed ModelConfig, validation and auto-complete."""

from quiver.config.model_config import (
    InstanceGroup,
    ModelConfig,
    TensorConfig,
    VersionPolicy,
    config_to_json,
    parse_model_config,
    parse_model_config_json,
)

__all__ = [
    "InstanceGroup",
    "ModelConfig",
    "TensorConfig",
    "VersionPolicy",
    "config_to_json",
    "parse_model_config",
    "parse_model_config_json",
]
