"""Model states, loading and unloading, control modes."""

from quiver.lifecycle.manager import ModelRepositoryManager
from quiver.lifecycle.model import Model, ModelState

__all__ = ["Model", "ModelRepositoryManager", "ModelState"]
