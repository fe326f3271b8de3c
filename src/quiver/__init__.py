"""Quiver: a Triton-compatible, multi-model inference server in Python."""

from __future__ import annotations

__version__ = "0.1.0"
