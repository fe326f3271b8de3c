"""A worker's outputs checked against the model configuration, as Triton checks a backend's:
each output the configuration names must have its datatype and a shape its dims allow (``-1``
any size; the batch dimension first when the model batches; outputs with a ``reshape`` are
not checked for shape)."""

from __future__ import annotations

from quiver.config import ModelConfig
from quiver.types import Tensor


class OutputCheck:
    """``check(outputs)``: what is wrong with ``outputs`` ("" if nothing)."""

    def __init__(self, config: ModelConfig) -> None:
        self._batch = config.max_batch_size
        self._outputs = {tensor.name: tensor for tensor in config.outputs}
        #: each output's dims as a list (None: reshaped, not checked), and as a tuple for the
        #: common exact match
        self._dims = {t.name: None if t.reshape is not None else list(t.dims) for t in config.outputs}
        self._exact = {t.name: tuple(t.dims) for t in config.outputs if t.reshape is None}

    def __call__(self, outputs: list[Tensor]) -> str:
        batching = self._batch > 0
        for tensor in outputs:
            spec = self._outputs.get(tensor.name)
            if spec is None:
                continue
            if tensor.datatype is not spec.datatype:
                return (
                    f"unexpected datatype {tensor.datatype.value} for output '{tensor.name}', "
                    f"the model configuration says {spec.datatype.value}"
                )
            dims = self._dims[tensor.name]
            if dims is None:
                continue
            # the usual: exactly the configured dims (a tuple shape; a list takes the long way)
            if (tensor.shape[1:] if batching else tensor.shape) == self._exact[tensor.name] and (
                tensor.shape or not batching
            ):
                continue
            shape = list(tensor.shape[1:] if batching else tensor.shape)
            if (batching and not tensor.shape) or len(shape) != len(dims) or any(
                d != -1 and d != s for d, s in zip(dims, shape, strict=True)
            ):
                return (
                    f"unexpected shape {list(tensor.shape)} for output '{tensor.name}', the model "
                    f"configuration says {spec.full_shape(self._batch)}"
                )
        return ""
