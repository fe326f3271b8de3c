"""TorchScript models built at test time (torch.jit.script / trace, then torch.jit.save).

The module classes live in this file because torch.jit.script reads their source. Import it
only where torch is installed (``pytest.importorskip("torch")`` first).
"""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import torch
from torch import Tensor


class AddSub(torch.nn.Module):
    """(x, y) -> (x + y, x - y): Triton's classic add_sub, as INPUT__0/INPUT__1 -> OUTPUT__0/1."""

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return x + y, x - y


class ScaleShift(torch.nn.Module):
    """Named arguments in an order the configuration does not follow."""

    def forward(self, shift: Tensor, values: Tensor, scale: Tensor) -> Tensor:
        return values * scale + shift


class Affine(torch.nn.Module):
    """x * 2 + 1 for any dtype; used for batching, FP16 and BF16."""

    def forward(self, x: Tensor) -> Tensor:
        return x * 2 + 1


class Counter(torch.nn.Module):
    """Counts its own executions in a buffer: x + calls. Instances that share one loaded
    module share the count; separately loaded instances count on their own."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(1, dtype=torch.float32))

    def forward(self, x: Tensor) -> Tensor:
        self.calls.add_(1)
        return x + self.calls


class Raises(torch.nn.Module):
    """Fails in forward for inputs whose sum is negative."""

    def forward(self, x: Tensor) -> Tensor:
        if bool(x.sum() < 0):
            raise RuntimeError("negative input is not allowed by this model")
        return x


class Upper(torch.nn.Module):
    """BYTES in and out as List[str], plus a tensor: (words, x) -> (upper(words), x * 2)."""

    def forward(self, words: list[str], x: Tensor) -> tuple[list[str], Tensor]:
        return [w.upper() for w in words], x * 2


class DictOut(torch.nn.Module):
    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"double": x * 2, "square": x * x}


class ListOut(torch.nn.Module):
    def forward(self, x: Tensor) -> list[Tensor]:
        return [x + 1, x + 2]


class DictIn(torch.nn.Module):
    def forward(self, inputs: dict[str, Tensor]) -> Tensor:
        return inputs["a"] - inputs["b"]


class ReturnsInt(torch.nn.Module):
    def forward(self, x: Tensor) -> int:
        return int(x.numel())


def script(module: torch.nn.Module) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.x deprecates TorchScript
        return torch.jit.script(module)  # type: ignore[no-any-return]


def traced_linear(inputs: int = 3, outputs: int = 2) -> torch.jit.ScriptModule:
    """A traced Linear layer with fixed weights (inputs must have ``inputs`` features)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(inputs, outputs)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.trace(layer, torch.zeros(1, inputs))  # type: ignore[no-any-return]


def write_torch(
    repo: Path,
    name: str,
    module: torch.jit.ScriptModule | None,
    config: str | None,
    version: int = 1,
    filename: str = "model.pt",
) -> Path:
    """``repo/name/version/filename`` (none when ``module`` is None) and ``config.pbtxt``."""
    folder = repo / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    if module is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.save(module, str(folder / str(version) / filename))
    if config is not None:
        (folder / "config.pbtxt").write_text(textwrap.dedent(config))
    return folder
