"""Moving tensors between processes: shared memory for the bytes, a small control channel for
everything else. Nothing else in Quiver knows how bytes cross a process boundary.

- :mod:`quiver.ipc.shm`: shared-memory segments under a name prefix and :class:`~quiver.ipc.shm.Arena`,
  a growing pool one side allocates from (the other side only maps it, :class:`~quiver.ipc.shm.Mapper`);
- :mod:`quiver.ipc.tensors`: tensors into a pool and back out as numpy views (BYTES tensors in
  Triton's length-prefixed encoding, :mod:`quiver.protocol.bytes_codec`);
- :mod:`quiver.ipc.channel`: length-prefixed JSON messages over a pair of pipes, blocking
  (:class:`~quiver.ipc.channel.Channel`) or on an asyncio loop (:class:`~quiver.ipc.channel.AsyncChannel`);
- :mod:`quiver.ipc.messages`: the message kinds both ends speak.

Every module here imports only the standard library, numpy and Quiver's worker-safe modules
(``quiver.errors``, ``quiver.types``, ``quiver.protocol.bytes_codec``), so a process running a
foreign Python environment (a model's ``EXECUTION_ENV_PATH``) can use it. Messages are JSON,
never pickle: a worker runs code the server does not trust, and nothing it sends may run code
in the server.
"""
