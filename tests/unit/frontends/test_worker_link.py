"""The worker <-> model side link: framed lists of messages, whole however the bytes arrive."""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any

import numpy as np

from quiver.frontends.worker_link import Link
from quiver.types import DataType, InferenceRequest, Tensor


def _frame(*messages: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(list(messages))
    return struct.pack("<I", len(body)) + body


def test_frames_split_and_joined_anyhow_arrive_whole_and_in_order() -> None:
    got: list[tuple[Any, ...]] = []
    link = Link(got.append, lambda: None)
    stream = b"".join(_frame(("infer", i, "x" * i)) for i in range(50))
    stream += _frame(*(("infer", i, "y" * i) for i in range(50, 60)))  # one frame, several messages
    expected = [("infer", i, "x" * i) for i in range(50)] + [("infer", i, "y" * i) for i in range(50, 60)]
    for size in (1, 3, 7, 64, len(stream)):
        got.clear()
        for start in range(0, len(stream), size):
            link.data_received(stream[start : start + size])
        assert got == expected


def test_messages_cross_a_socket_pair_with_tensors_and_the_end_is_noticed() -> None:
    async def main() -> tuple[list[tuple[Any, ...]], bool]:
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        received: list[tuple[Any, ...]] = []
        lost = asyncio.Event()
        _, sender = await loop.create_unix_connection(lambda: Link(lambda m: None, lambda: None), sock=left)
        await loop.create_unix_connection(lambda: Link(received.append, lost.set), sock=right)
        request = InferenceRequest("simple", "", [Tensor("INPUT0", DataType.INT32, (1, 16), np.arange(16, dtype=np.int32).reshape(1, 16))])
        for i in range(100):  # sent in one loop turn: they leave together
            sender.send(("infer", i, request))
        big = np.arange(1 << 18, dtype=np.float32)  # a frame past what is written joined
        sender.send(("infer", 100, InferenceRequest("simple", "", [Tensor("BIG", DataType.FP32, big.shape, big)])))
        while len(received) < 101:
            await asyncio.sleep(0.01)
        sender.close()
        await asyncio.wait_for(lost.wait(), 10)
        return received, lost.is_set()

    received, lost = asyncio.run(main())
    assert [m[1] for m in received] == list(range(101))
    np.testing.assert_array_equal(received[-1][2].inputs[0].data, np.arange(1 << 18, dtype=np.float32))
    tensor = received[-2][2].inputs[0]
    assert tensor.datatype is DataType.INT32
    np.testing.assert_array_equal(tensor.data, np.arange(16, dtype=np.int32).reshape(1, 16))
    assert lost


def test_a_frame_past_the_limit_closes_the_link() -> None:
    closed: list[bool] = []

    class Transport:
        def close(self) -> None:
            closed.append(True)

        def is_closing(self) -> bool:
            return bool(closed)

    got: list[tuple[Any, ...]] = []
    link = Link(got.append, lambda: None)
    link.connection_made(Transport())  # type: ignore[arg-type]
    link.data_received(struct.pack("<I", (1 << 31) + 1) + b"x")
    assert closed == [True] and got == []
