"""TensorFlow models built at test time: small frozen GraphDefs and a SavedModel (the seed's
Inception v3 is built by ``examples/seed_ensemble.py``).

Importing this module imports TensorFlow: callers skip first when it is not installed."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf


def graph_bytes(build: object) -> bytes:
    """A frozen GraphDef of what ``build()`` adds to a fresh v1 graph."""
    graph = tf.Graph()
    with graph.as_default():
        build()  # type: ignore[operator]
    return bytes(graph.as_graph_def().SerializeToString())


def add_sub_graphdef(batch: int | None = None, features: int = 4) -> bytes:
    """Triton's ``simple`` as a GraphDef: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""

    def build() -> None:
        a = tf.compat.v1.placeholder(tf.float32, [batch, features], name="INPUT0")
        b = tf.compat.v1.placeholder(tf.float32, [batch, features], name="INPUT1")
        tf.identity(a + b, name="OUTPUT0")
        tf.identity(a - b, name="OUTPUT1")

    return graph_bytes(build)


def strings_graphdef() -> bytes:
    """BYTES in, BYTES out: ``upper`` = the upper-case of ``text``; ``length`` its length."""

    def build() -> None:
        text = tf.compat.v1.placeholder(tf.string, [None, None], name="text")
        tf.strings.upper(text, name="upper")
        tf.strings.length(text, name="length")

    return graph_bytes(build)


def scale_graphdef_fixed_batch_of_one(features: int = 3) -> bytes:
    """A graph whose placeholder fixes the batch to 1: ``y = 2 * x + sum(x)`` (the sum ties
    the row's elements together, so a batch fed whole would be wrong, not just refused)."""

    def build() -> None:
        x = tf.compat.v1.placeholder(tf.float32, [1, features], name="x")
        tf.identity(2.0 * x + tf.reduce_sum(x), name="y")

    return graph_bytes(build)


class _Affine(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])

    @tf.function(
        input_signature=[
            tf.TensorSpec([None, 3], tf.float32, name="features"),
            tf.TensorSpec([None], tf.string, name="tag"),
        ]
    )
    def serve(self, features: tf.Tensor, tag: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"scores": tf.matmul(features, self.w), "tag_upper": tf.strings.upper(tag)}


def write_saved_model(path: Path) -> Path:
    """A TF2 SavedModel: ``serving_default`` takes ``features`` FP32 [-1, 3] and ``tag``
    BYTES [-1]; gives ``scores`` = features @ [[1, 2], [3, 4], [5, 6]] and ``tag_upper``."""
    module = _Affine()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})
    return path
