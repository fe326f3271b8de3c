"""The messages both ends of a worker's control channel speak (JSON objects, key ``op``).

One request id may get any number of ``response`` messages; the last one carries
``flags & FINAL`` (a model that is not decoupled sends exactly one). Messages that belong to no
request (``cancel``, ``release``, ``log``) may be sent at any time, in either direction where
it makes sense. Tensors travel as descriptors (:mod:`quiver.ipc.tensors`), never inline.

Server -> worker:
  ``init`` {args, auto_complete?}          ``execute`` {batch, requests: [request, ...]}
  ``cancel`` {ids}                         ``bls_response`` {id, response}
  ``release`` {blocks}                     ``finalize`` {}

Worker -> server:
  ``ready`` {pid, config?}                 ``init_error`` {code, message}
  ``response`` {id, response, flags}       ``done`` {batch, error?}
  ``bls`` {id, request}                    ``release`` {blocks}
  ``log`` {level, message}                 ``finalized`` {}

A request: {id, tensors, requested, correlation_id, flags, timeout, parameters, model_name,
model_version}; a response: {tensors, error?: [code, message], parameters}.
"""

from __future__ import annotations

#: ``response`` flags: the last response for its request id.
FINAL = 1

INIT = "init"
EXECUTE = "execute"
CANCEL = "cancel"
BLS = "bls"
BLS_RESPONSE = "bls_response"
RELEASE = "release"
FINALIZE = "finalize"
READY = "ready"
INIT_ERROR = "init_error"
RESPONSE = "response"
DONE = "done"
LOG = "log"
FINALIZED = "finalized"
