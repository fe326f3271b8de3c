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
  ``response`` {id, response, flags}       ``done`` {batch, error?, start?, cpu?}
  ``bls`` {id, request}                    ``release`` {blocks}
  ``log`` {level, message}                 ``finalized`` {}
  ``bls_cancel`` {id}                      ``is_ready_result`` {id, ready, error?}

``is_ready`` {id} (server -> worker) asks the model's own ``is_ready()``; ``ready`` says
whether it has one (``has_is_ready``).

Decoupled models: a ``response`` may come after ``done`` (sent from a thread the model
started), its ``response`` is null for a flag-only final, and ``cancel`` may come after
``done`` too (the client went away mid-stream). A BLS ``request`` with ``decoupled: true`` gets
any number of ``bls_response`` {id, response, flags} (``response`` null for the called
model's flag-only final), the last with FINAL; ``bls_cancel`` cancels it.

A request: {id, tensors, fields?, traced?} (``fields``: what differs from the defaults of
``pb_utils.InferenceRequest``); a response: {tensors, error?: [code, message], parameters?}.
``init``'s ``report_cpu`` asks the worker to name in each ``done`` the CPU that ran the batch
(``cpu``; null when the system does not say). A ``done`` carries the batch's final responses as ``responses`` (each response with its
request's ``id``), so that a batch answered at once costs one message.
"""

from __future__ import annotations

#: ``response`` flags: the last response for its request id.
FINAL = 1

INIT = "init"
EXECUTE = "execute"
CANCEL = "cancel"
BLS = "bls"
BLS_RESPONSE = "bls_response"
BLS_CANCEL = "bls_cancel"
IS_READY = "is_ready"
IS_READY_RESULT = "is_ready_result"
RELEASE = "release"
FINALIZE = "finalize"
READY = "ready"
INIT_ERROR = "init_error"
RESPONSE = "response"
DONE = "done"
LOG = "log"
FINALIZED = "finalized"
