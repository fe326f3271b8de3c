"""Python models for the decoupled, streaming and response-sender tests (built at test time)."""

from __future__ import annotations

from pathlib import Path

from build_repository import TOKEN_STREAMER_CONFIG, TOKEN_STREAMER_MODEL

from support.models import write_config, write_python

#: Decoupled: COUNT responses (OUT = 0..COUNT-1, parameters index/count), then the final flag.
#: The request parameter ``mode`` picks a behaviour:
#:   inline       - send everything from execute (default)
#:   thread       - send from a thread the model starts, after execute returned
#:   final_with   - the last response carries the final flag itself
#:   error_mid    - response 1 is an error (INVALID_ARG), the stream goes on
#:   raise_mid    - send COUNT responses, then raise from execute
#:   return_list  - send nothing and return a list (decoupled execute must return None)
#:   after_final  - send, final, then try to send again (the error is remembered)
#:   wait_cancel  - send one response, then wait (thread) until cancelled; remembered
#:   report       - one response: OUT = 1 if a wait_cancel saw its cancellation; TEXT = the
#:                  remembered error text
STREAMER_MODEL = """
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    remembered = ""
    saw_cancel = threading.Event()

    def _response(self, value, index, count):
        return pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
             pb_utils.Tensor("TEXT", np.array([b""], dtype=np.object_))],
            parameters={"index": index, "count": count, "model": "streamer"},
        )

    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            mode = json.loads(request.parameters()).get("mode", "inline")
            sender = request.get_response_sender()
            if mode == "thread":
                threading.Thread(target=self._send_all, args=(sender, count, 0.01)).start()
            elif mode == "final_with":
                for i in range(count):
                    flags = FINAL if i == count - 1 else 0
                    sender.send(self._response(i, i, count), flags=flags)
                if count == 0:
                    sender.send(flags=FINAL)
            elif mode == "error_mid":
                for i in range(count):
                    if i == 1:
                        sender.send(pb_utils.InferenceResponse(
                            error=pb_utils.TritonError("token 1 failed", pb_utils.TritonError.INVALID_ARG)))
                    else:
                        sender.send(self._response(i, i, count))
                sender.send(flags=FINAL)
            elif mode == "raise_mid":
                for i in range(count):
                    sender.send(self._response(i, i, count))
                raise RuntimeError("the model broke mid-stream")
            elif mode == "return_list":
                return [pb_utils.InferenceResponse([]) for _ in requests]
            elif mode == "after_final":
                sender.send(self._response(0, 0, 1), flags=FINAL)
                try:
                    sender.send(self._response(1, 1, 1))
                except pb_utils.TritonModelException as exc:
                    TritonPythonModel.remembered = str(exc)
            elif mode == "wait_cancel":
                TritonPythonModel.saw_cancel.clear()
                sender.send(self._response(0, 0, 1))
                threading.Thread(target=self._wait_cancel, args=(sender, request)).start()
            elif mode == "report":
                out = pb_utils.Tensor("OUT", np.array([int(TritonPythonModel.saw_cancel.is_set())], dtype=np.int32))
                text = pb_utils.Tensor("TEXT", np.array([TritonPythonModel.remembered.encode()], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse([out, text]), flags=FINAL)
            else:
                self._send_all(sender, count, 0)
        return None

    def _send_all(self, sender, count, delay):
        for i in range(count):
            if delay:
                time.sleep(delay)
            sender.send(self._response(i, i, count))
        sender.send(flags=FINAL)

    def _wait_cancel(self, sender, request):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sender.is_cancelled() and request.is_cancelled():
                TritonPythonModel.saw_cancel.set()
                break
            time.sleep(0.01)
        sender.send(flags=FINAL)  # still needed after a cancellation
"""

STREAMER_CONFIG = """
name: "streamer"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

#: Not decoupled, but answering through the response sender (Triton 24.06+). The request
#: parameter ``mode``: ``sender`` (send + final, return None), ``early_final`` (final before a
#: response fails; the message is the answer), ``twice`` (a second response fails; the
#: message is remembered, the first response is the answer), ``report`` (the remembered
#: message), ``returned`` (return the response the usual way), ``wait_cancel`` (wait in
#: execute until ``is_cancelled()``; "cancelled" is remembered), ``bad_key`` / ``bad_value``
#: (response parameters Triton refuses: execute raises).
SENDER_MODEL = """
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def text(value):
    return pb_utils.InferenceResponse(
        [pb_utils.Tensor("TEXT", np.array([value.encode()], dtype=np.object_))],
        parameters={"via": "sender"},
    )


class TritonPythonModel:
    remembered = ""

    def execute(self, requests):
        results = []
        for request in requests:
            mode = json.loads(request.parameters()).get("mode", "sender")
            sender = request.get_response_sender()
            if mode == "returned":
                results.append(text("returned"))
                continue
            if mode == "bad_key":
                pb_utils.InferenceResponse([], parameters={1: "x"})
            if mode == "bad_value":
                pb_utils.InferenceResponse([], parameters={"ratio": 0.5})
            results.append(None)
            if mode == "sender":
                sender.send(text("sent"))
                sender.send(flags=FINAL)
            elif mode == "early_final":
                try:
                    sender.send(flags=FINAL)
                except pb_utils.TritonModelException as exc:
                    sender.send(text(str(exc)), flags=FINAL)
            elif mode == "twice":
                sender.send(text("first"))
                try:
                    sender.send(text("second"))
                except pb_utils.TritonModelException as exc:
                    TritonPythonModel.remembered = str(exc)
                sender.send(flags=FINAL)
            elif mode == "report":
                sender.send(text(TritonPythonModel.remembered), flags=FINAL)
            elif mode == "wait_cancel":
                TritonPythonModel.remembered = "waiting"
                deadline = time.monotonic() + 30
                while not request.is_cancelled() and time.monotonic() < deadline:
                    time.sleep(0.01)
                TritonPythonModel.remembered = "cancelled" if request.is_cancelled() else "not cancelled"
                sender.send(text("done"), flags=FINAL)
        return results
"""

SENDER_CONFIG = """
name: "sender_plain"
backend: "python"
max_batch_size: 0
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

#: Decoupled with ``async def execute``: each request sleeps DELAY ms, then answers with the
#: most executions it saw running at once on its one instance; a negative DELAY makes a BLS
#: call (``await async_exec()``) instead.
ASYNC_MODEL = """
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.running = 0
        self.most = 0

    async def execute(self, requests):
        for request in requests:
            delay = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            sender = request.get_response_sender()
            if delay < 0:  # BLS from the background: OUT = len(sender_plain's TEXT), 8
                call = pb_utils.InferenceRequest(
                    model_name="sender_plain", requested_output_names=["TEXT"],
                    inputs=[pb_utils.Tensor("COUNT", np.array([0], dtype=np.int32))],
                    parameters={"mode": "returned"},
                )
                answer = await call.async_exec()
                text = pb_utils.get_output_tensor_by_name(answer, "TEXT").as_numpy()[0]
                out = pb_utils.Tensor("OUT", np.array([len(text)], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse([out]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self.running += 1
            self.most = max(self.most, self.running)
            try:
                await asyncio.sleep(delay / 1000)
            finally:
                self.running -= 1
            out = pb_utils.Tensor("OUT", np.array([self.most], dtype=np.int32))
            sender.send(pb_utils.InferenceResponse([out]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

ASYNC_CONFIG = """
name: "async_streamer"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

#: Not decoupled: calls ``streamer`` through BLS with decoupled=True and answers with what
#: came back. Request parameter ``mode``: ``collect`` (OUT: every value, then -1 for the
#: empty last response), ``cancel`` (streamer's wait_cancel, cancel after the first response;
#: OUT: the number of responses), ``not_decoupled`` (exec() without decoupled=True: TEXT is
#: the error), ``async`` (like collect, from async_exec).
BLS_MODEL = """
import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def call(count, mode="inline"):
    return pb_utils.InferenceRequest(
        model_name="streamer",
        requested_output_names=["OUT"],
        inputs=[pb_utils.Tensor("COUNT", np.array([count], dtype=np.int32))],
        parameters={"mode": mode},
    )


def answer(values, text=""):
    return pb_utils.InferenceResponse([
        pb_utils.Tensor("OUT", np.array(values, dtype=np.int32)),
        pb_utils.Tensor("TEXT", np.array([text.encode()], dtype=np.object_)),
    ])


def values_of(responses):
    values = []
    for response in responses:
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        out = pb_utils.get_output_tensor_by_name(response, "OUT")
        values.append(int(out.as_numpy()[0]) if out is not None else -1)
    return values


class TritonPythonModel:
    async def execute(self, requests):
        results = []
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            mode = json.loads(request.parameters()).get("mode", "collect")
            if mode == "collect":
                results.append(answer(values_of(call(count).exec(decoupled=True))))
            elif mode == "async":
                iterators = await asyncio.gather(*(call(count).async_exec(decoupled=True) for _ in range(2)))
                results.append(answer([v for it in iterators for v in values_of(it)]))
            elif mode == "cancel":
                responses = call(1, "wait_cancel").exec(decoupled=True)
                first = next(responses)
                responses.cancel()
                rest = list(responses)
                results.append(answer([1 + len(rest)], "ok" if not first.has_error() else "error"))
            elif mode == "not_decoupled":
                response = call(count).exec()
                results.append(answer([], response.error().message() if response.has_error() else ""))
        return results
"""

BLS_CONFIG = """
name: "bls_stream"
backend: "python"
max_batch_size: 0
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }
]
"""

#: ``is_ready()`` reads the file named by the config parameter READY_FILE: "true", "false",
#: "raise", "slow" (sleeps 7 s), anything else returns that string (not a boolean).
READY_MODEL = """
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.path = config["parameters"]["READY_FILE"]["string_value"]

    def is_ready(self):
        state = open(self.path).read().strip()
        if state == "raise":
            raise RuntimeError("the database is down")
        if state == "slow":
            time.sleep(7)
            return True
        if state in ("true", "false"):
            return state == "true"
        return state

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], dtype=np.int32))]) for _ in requests]
"""

READY_CONFIG = """
name: "ready_check"
backend: "python"
max_batch_size: 0
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
parameters { key: "READY_FILE" value { string_value: "%s" } }
"""

#: A model of the generate extension's tests: PROMPT and STREAM (and optional input_ids);
#: answers TEXT = PROMPT, REPETITION times (a request parameter, default 1) when STREAM, else
#: once; FAIL_LAST ends the stream with an error.
MOCK_LLM_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            params = json.loads(request.parameters())
            repetition = params.get("REPETITION", 1)
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
            stream = bool(pb_utils.get_input_tensor_by_name(request, "STREAM").as_numpy().reshape(-1)[0])
            sender = request.get_response_sender()
            response = pb_utils.InferenceResponse(
                [pb_utils.Tensor("TEXT", prompt)], parameters={"model_param": "mock"}
            )
            if not stream:
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            for _ in range(repetition):
                sender.send(response)
            last = None
            if params.get("FAIL_LAST"):
                last = pb_utils.InferenceResponse(error=pb_utils.TritonError("An Error Occurred"))
            sender.send(last, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

MOCK_LLM_CONFIG = """
name: "mock_llm"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "PROMPT" data_type: TYPE_STRING dims: [ 1, 1 ] },
  { name: "STREAM" data_type: TYPE_BOOL dims: [ 1, 1 ] },
  { name: "input_ids" data_type: TYPE_INT32 dims: [ 1, -1 ] optional: true }
]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1, -1 ] } ]
"""


#: An ensemble whose one step is the decoupled ``streamer`` (a step takes one answer: refused).
ENSEMBLE_CONFIG = """
name: "stream_ensemble"
platform: "ensemble"
max_batch_size: 0
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [ {
  model_name: "streamer" model_version: -1
  input_map { key: "COUNT" value: "COUNT" } output_map { key: "OUT" value: "OUT" }
} ] }
"""


def build_decoupled_repository(root: Path) -> Path:
    """Every model above, the example token streamer, and a file ``ready_state`` that
    ``ready_check`` reads ("true" to begin with)."""
    repo = root / "models"
    repo.mkdir()
    ready_file = root / "ready_state"
    ready_file.write_text("true")
    write_python(repo, "streamer", STREAMER_MODEL, STREAMER_CONFIG)
    warm = STREAMER_CONFIG.replace('name: "streamer"', 'name: "warm_streamer"') + """
model_warmup [ { name: "zero" batch_size: 1
  inputs { key: "COUNT" value { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } } ]
"""
    write_python(repo, "warm_streamer", STREAMER_MODEL, warm)
    write_python(repo, "sender_plain", SENDER_MODEL, SENDER_CONFIG)
    write_python(repo, "async_streamer", ASYNC_MODEL, ASYNC_CONFIG)
    write_python(repo, "bls_stream", BLS_MODEL, BLS_CONFIG)
    write_python(repo, "ready_check", READY_MODEL, READY_CONFIG % ready_file)
    write_python(repo, "mock_llm", MOCK_LLM_MODEL, MOCK_LLM_CONFIG)
    write_python(repo, "token_streamer", TOKEN_STREAMER_MODEL, TOKEN_STREAMER_CONFIG)
    write_config(repo, "stream_ensemble", ENSEMBLE_CONFIG)
    return repo
