"""Triton's ``identity`` test backend: input *i* is copied to output *i*.

Cheap enough to run on the event loop: no executor hop.
"""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import ExecuteResult, ExecutionTiming, InstanceSpec, ModelFiles
from quiver.config import ModelConfig
from quiver.errors import InvalidArgumentError
from quiver.types import InferenceRequest, InferenceResponse, Tensor


class IdentityInstance:
    def __init__(self, config: ModelConfig, spec: InstanceSpec) -> None:
        self.name = spec.name
        self.timing = ExecutionTiming()
        self._config = config
        self._pairs = list(zip(config.inputs, config.outputs, strict=False))

    async def run(self, requests: list[InferenceRequest]) -> ExecuteResult:
        results: ExecuteResult = []
        for request in requests:
            outputs = []
            for in_cfg, out_cfg in self._pairs:
                tensor = request.input(in_cfg.name)
                if tensor is None:
                    continue  # an optional input that was not sent
                outputs.append(
                    Tensor(out_cfg.name, tensor.datatype, tensor.shape, tensor.data)
                )
            results.append(
                InferenceResponse(self._config.name, "", outputs, request.id)
            )
        return results

    def unload(self) -> None:
        pass


class IdentityBackend:
    name = "identity"

    def auto_complete(self, config: pb.ModelConfig, files: ModelFiles, strict: bool) -> None:
        return None

    def create_instance(
        self, config: ModelConfig, files: ModelFiles, spec: InstanceSpec
    ) -> IdentityInstance:
        for in_cfg, out_cfg in zip(config.inputs, config.outputs, strict=False):
            if in_cfg.datatype is not out_cfg.datatype:
                raise InvalidArgumentError(
                    f"model '{config.name}': identity backend copies input '{in_cfg.name}' "
                    f"({in_cfg.datatype.value}) to output '{out_cfg.name}', which is "
                    f"{out_cfg.datatype.value}"
                )
        return IdentityInstance(config, spec)


BACKEND = IdentityBackend()
