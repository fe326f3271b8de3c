"""The TensorFlow backend's parameters (Triton's names, :func:`parse_settings`), the session
configuration they make, and the check of ``SAGEMAKER_TRITON_TENSORFLOW_VERSION``; see
:mod:`quiver.backends.tensorflow`.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's C++ start-up chatter, before import

import tensorflow as tf

from quiver.errors import ConfigError

logger = logging.getLogger(
    "quiver.backends.tensorflow"
)  # the backend's logger, as before the split

_TRUE = ("true", "on", "1", "yes")

# --- parameters ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TFSettings:
    intra_threads: int = 0
    inter_threads: int = 0
    per_session_threads: bool = False
    graph_tag: str = ""
    signature_def: str = ""
    init_ops_file: str = ""


def parse_settings(parameters: dict[str, str], model: str, source: str) -> TFSettings:
    def count(key: str) -> int:
        text = parameters.get(key, "").strip()
        if not text:
            return 0
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise ConfigError(
                f"{source}: parameter '{key}' of model '{model}' must be a non-negative "
                f"integer, got '{parameters[key]}'"
            )
        return value

    init_ops = parameters.get("TF_INIT_OPS_FILE", "").strip()
    if init_ops and (Path(init_ops).is_absolute() or ".." in Path(init_ops).parts):
        raise ConfigError(
            f"{source}: parameter 'TF_INIT_OPS_FILE' of model '{model}' must name a file inside "
            f"the model's folder, got '{init_ops}'"
        )
    return TFSettings(
        intra_threads=count("TF_NUM_INTRA_THREADS"),
        inter_threads=count("TF_NUM_INTER_THREADS"),
        per_session_threads=parameters.get("TF_USE_PER_SESSION_THREADS", "").strip().lower()
        in _TRUE,
        graph_tag=parameters.get("TF_GRAPH_TAG", "").strip(),
        signature_def=parameters.get("TF_SIGNATURE_DEF", "").strip(),
        init_ops_file=init_ops,
    )


def _session_config(settings: TFSettings) -> Any:
    config = tf.compat.v1.ConfigProto()
    config.intra_op_parallelism_threads = settings.intra_threads
    config.inter_op_parallelism_threads = settings.inter_threads
    config.use_per_session_threads = settings.per_session_threads
    config.allow_soft_placement = True
    return config


_VERSION_CHECKED = threading.Event()


def _check_version_variable() -> None:
    """``SAGEMAKER_TRITON_TENSORFLOW_VERSION``: accepted; TensorFlow 2 is what runs."""
    if _VERSION_CHECKED.is_set():
        return
    _VERSION_CHECKED.set()
    wanted = os.environ.get("SAGEMAKER_TRITON_TENSORFLOW_VERSION", "").strip()
    if wanted and wanted != "2" and not wanted.startswith("2."):
        logger.warning(
            "SAGEMAKER_TRITON_TENSORFLOW_VERSION=%s: TensorFlow %s serves every TensorFlow "
            "model here (Triton has supported only TensorFlow 2 since 23.04)",
            wanted,
            tf.__version__,
        )
