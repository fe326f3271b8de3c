"""quiver.ipc: shared-memory pools (allocation, growth, limits, names), tensors through them
(numpy views, BYTES), and the control channel's framing."""

from __future__ import annotations

import asyncio
import math
import os
import time
import uuid
from typing import Any

import numpy as np
import pytest

from quiver.ipc import tensors
from quiver.ipc.channel import MAX_FRAME, AsyncChannel, Channel, ChannelError, encode, pipe_pair
from quiver.ipc.shm import SHM_DIR, Arena, Mapper, PoolFullError, unlink_prefixed


@pytest.fixture
def prefix() -> str:
    tag = f"quiver_unit_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
    yield tag
    unlink_prefixed(tag)


def test_an_arena_reuses_freed_blocks_and_grows_by_segments(prefix: str) -> None:
    arena = Arena(prefix + "a", 4096, 8192, 64 * 1024)
    first, view = arena.alloc(1000)
    view[:3] = b"abc"
    second, _ = arena.alloc(3000)
    assert first.segment == second.segment and arena.total_bytes == 4096
    third, _ = arena.alloc(5000)  # does not fit the first segment: a second one, >= growth
    assert third.segment != first.segment and arena.total_bytes == 4096 + 8192
    arena.free(first.segment, first.offset)
    arena.free(second.segment, second.offset)
    again, _ = arena.alloc(4000)  # the freed neighbours were merged
    assert (again.segment, again.offset) == (first.segment, 0)
    assert sorted(os.listdir(SHM_DIR)).count(first.segment) == 1
    arena.close()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]


def test_an_arena_keeps_a_freed_block_for_its_size_and_gives_it_back_when_room_runs_short(prefix: str) -> None:
    arena = Arena(prefix + "a", 4096, 4096, 4096)  # one segment, no growth
    first, _ = arena.alloc(100)
    second, _ = arena.alloc(100)
    arena.free(first.segment, first.offset)
    again, _ = arena.alloc(100)  # the same size: the block freed last, whole
    assert (again.segment, again.offset) == (first.segment, first.offset)
    assert arena.used_bytes == 256
    arena.free(again.segment, again.offset)
    arena.free(second.segment, second.offset)
    assert arena.used_bytes == 0
    everything, _ = arena.alloc(4096)  # needs the whole segment: the kept blocks are merged back
    assert (everything.offset, arena.total_bytes) == (0, 4096)
    arena.free(everything.segment, everything.offset)
    block = arena.store(np.arange(4, dtype=np.int32), 16)  # a copy of a buffer, in one call
    assert bytes(Mapper(prefix + "a").view(block.segment, block.offset, 16)) == np.arange(4, dtype=np.int32).tobytes()
    with pytest.raises(ValueError, match="contiguous"):
        arena.store(np.arange(8, dtype=np.int32)[::2], 16)
    assert arena.used_bytes == 64  # the block of the copy that failed was given back
    arena.close()


def test_a_full_pool_names_its_sizes_and_the_setting(prefix: str) -> None:
    arena = Arena(prefix + "a", 4096, 4096, 8192)
    arena.alloc(4096)
    arena.alloc(4096)
    with pytest.raises(PoolFullError, match=r"needs 64 more bytes but holds 8192 of at most 8192 bytes.*shm-max-byte-size"):
        arena.alloc(10)
    arena.close()


@pytest.mark.parametrize(
    ("datatype", "array"),
    [
        ("FP32", np.arange(12, dtype=np.float32).reshape(3, 4)),
        ("INT64", np.array([], dtype=np.int64).reshape(0, 2)),
        ("BOOL", np.array([True, False])),
        ("FP64", np.arange(12, dtype=np.float64).reshape(3, 4).T),  # strided: copied contiguous
        ("BYTES", np.array([b"a", b"", "\u00e9".encode()], dtype=object).reshape(1, 3)),
    ],
)
def test_tensors_cross_as_views_of_the_pool(prefix: str, datatype: str, array: np.ndarray) -> None:  # type: ignore[type-arg]
    arena = Arena(prefix + "s", 4096, 4096, 1 << 20)
    blocks: list[tuple[str, int]] = []
    descriptor = tensors.write(arena, "T", datatype, array, blocks)
    mapper = Mapper(prefix + "s")
    name, got_type, shape, got = tensors.read(mapper, descriptor)
    assert (name, got_type, shape) == ("T", datatype, array.shape)
    assert got.tolist() == array.tolist()
    if datatype == "FP32":
        assert not got.flags.owndata  # a view of the shared memory, no copy
        arena_view = mapper.view(descriptor[3], descriptor[4], descriptor[5])
        np.frombuffer(arena_view, dtype=np.float32)[0] = 99  # both sides see one memory
        assert got[0, 0] == 99
    assert tensors.blocks_of([descriptor]) == [list(block) for block in blocks]
    mapper.close()
    arena.close()


def test_a_mapper_refuses_other_names_and_blocks_outside_a_segment(prefix: str) -> None:
    arena = Arena(prefix + "s", 4096, 4096, 1 << 20)
    block, _ = arena.alloc(10)
    mapper = Mapper(prefix + "s")
    with pytest.raises(ValueError, match="not one of this channel's"):
        mapper.view("some_other_segment", 0, 1)
    with pytest.raises(ValueError, match="outside segment"):
        mapper.view(block.segment, 4000, 200)
    with pytest.raises(ValueError, match="do not hold shape"):
        tensors.read(mapper, ["T", "FP32", [4], block.segment, 0, 10])
    mapper.close()
    arena.close()


def test_the_channel_frames_json_messages_both_ways() -> None:
    left, right = pipe_pair()
    sender, receiver = Channel(left), Channel(right)
    sender.send({"op": "response", "id": "7", "flags": 1})
    sender.send({"op": "log", "message": "x" * 100_000})
    assert receiver.recv() == {"op": "response", "id": "7", "flags": 1}
    assert receiver.recv()["message"] == "x" * 100_000  # type: ignore[index]

    async def over_asyncio() -> None:
        got: asyncio.Queue[dict[str, object]] = asyncio.Queue()
        ends: list[Exception | None] = []
        channel = await AsyncChannel.open(right, got.put_nowait, ends.append)
        sender.send({"op": "done", "batch": 1})
        assert await asyncio.wait_for(got.get(), 5) == {"op": "done", "batch": 1}
        channel.send({"op": "cancel", "ids": ["1"]})
        await asyncio.sleep(0)
        assert sender.recv() == {"op": "cancel", "ids": ["1"]}
        deadline = time.monotonic() + 5
        os.write(left[1], b"\x05\x00\x00\x00[1,2]")  # not a message: the channel ends, naming why
        while not ends and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert isinstance(ends[0], ChannelError) and "not an object" in str(ends[0])
        assert got.empty() and len(ends) == 1
        channel.close()  # it owns the pipes it was given
        await asyncio.sleep(0)
        # one whole frame that is not JSON (read at once, as an answer is): the channel ends
        a, b = pipe_pair()
        broken: list[Exception | None] = []
        other = await AsyncChannel.open(b, got.put_nowait, broken.append)
        os.write(a[1], b"\x05\x00\x00\x00{op:1")
        while not broken and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert isinstance(broken[0], ChannelError) and "not JSON" in str(broken[0])
        assert got.empty() and len(broken) == 1
        other.close()
        Channel(a).close()
        await asyncio.sleep(0)

    async def oversized_and_closed() -> None:
        a, b = pipe_pair()
        ends: list[Exception | None] = []
        first = await AsyncChannel.open(b, lambda message: None, ends.append)
        os.write(a[1], (MAX_FRAME + 1).to_bytes(4, "little"))
        deadline = time.monotonic() + 5
        while not ends and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert isinstance(ends[0], ChannelError) and "a frame of" in str(ends[0])
        Channel(a).close()
        c, d = pipe_pair()
        closed: list[Exception | None] = []
        second = await AsyncChannel.open(d, lambda message: None, closed.append)
        Channel(c).close()  # the peer went away: ended(None), once
        while not closed and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert closed == [None]
        for channel in (first, second):
            channel.close()
        await asyncio.sleep(0)

    asyncio.run(over_asyncio())
    asyncio.run(oversized_and_closed())
    sender.close()
    assert encode({"op": "x"})[:4] == (len(b'{"op":"x"}')).to_bytes(4, "little")


@pytest.mark.parametrize("with_orjson", [True, False], ids=["orjson", "json"])
def test_frames_read_the_same_with_or_without_orjson(monkeypatch: pytest.MonkeyPatch, with_orjson: bool) -> None:
    """A worker under a Python without orjson speaks the same frames as the server with it."""
    from quiver.ipc import channel as channel_module

    if not with_orjson:
        monkeypatch.setattr(channel_module, "_orjson", None)
    message = {"op": "execute", "batch": 3, "text": "héllo \u2603", "nested": [{"a": 1.5}, None]}
    huge = {"op": "execute", "value": 123456789012345678901234567, "u64": (1 << 64) - 1, "none": None}
    nonfinite = {"op": "execute", "parameters": {"x": float("inf"), "y": [float("-inf"), None]}, "z": None}
    left, right = pipe_pair()
    sender, receiver = Channel(left), Channel(right, buffered=True)
    try:
        sender.send_many([message, huge, nonfinite, {"op": "nan", "v": float("nan")}])
        assert receiver.recv() == message
        got = receiver.recv()
        assert got == huge and isinstance(got["value"], int)  # not a float on the way
        assert receiver.recv() == nonfinite  # not null on the way
        got = receiver.recv()
        assert got is not None and math.isnan(got["v"])
    finally:
        sender.close()
        receiver.close()
    with pytest.raises(ChannelError, match="not JSON"):
        channel_module.decode(b"{broken")
    with pytest.raises(ChannelError, match="'op'"):
        channel_module.decode(b"[1]")


def test_the_async_channel_reads_frames_however_the_bytes_arrive() -> None:
    """Several frames in one read, a frame split over reads (its length word too), an exact
    frame (an integer over 64 bits): each message is delivered once, whole, in order."""
    messages = [
        {"op": "done", "batch": 1, "responses": [{"id": "1", "response": {"tensors": []}, "flags": 1}]},
        {"op": "log", "message": "x" * 5000},
        {"op": "response", "id": "2", "value": 123456789012345678901234567},
        {"op": "done", "batch": 2},
    ]
    stream = b"".join(encode(message) for message in messages)
    cuts = [3, 40, 41, 5100, len(stream) - 2, len(stream)]

    async def feed() -> list[dict[str, object]]:
        left, right = pipe_pair()
        got: list[dict[str, object]] = []
        ends: list[Exception | None] = []
        channel = await AsyncChannel.open(right, got.append, ends.append)
        start = 0
        for cut in cuts:
            os.write(left[1], stream[start:cut])
            start = cut
            await asyncio.sleep(0.01)
        deadline = time.monotonic() + 5
        while len(got) < len(messages) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not ends
        channel.close()
        await asyncio.sleep(0)
        Channel(left).close()
        return got

    got = asyncio.run(feed())
    assert got == messages
    assert isinstance(got[2]["value"], int)


async def _read_at_once(
    frame: bytes, deliver: Any = None
) -> tuple[list[dict[str, Any]], list[Exception | None], bool]:
    """``frame`` written in one write, so the channel reads it whole in one go (its quick path
    for one small message): what was delivered, how the channel ended, whether it closed."""
    ours, theirs = pipe_pair()
    got: list[dict[str, Any]] = []
    ends: list[Exception | None] = []
    channel = await AsyncChannel.open(theirs, deliver or got.append, ends.append)
    os.write(ours[1], frame)
    deadline = time.monotonic() + 5
    while not got and not ends and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.02)
    closing = channel._transport is not None and channel._transport.is_closing()
    got, ends = list(got), list(ends)  # before close() adds its own end
    channel.close()
    Channel(ours).close()
    await asyncio.sleep(0)
    return got, ends, closing


def test_a_small_exact_frame_read_at_once_keeps_its_values() -> None:
    """An exact frame (integers over 64 bits, NaN) read whole: decoded exactly, not by orjson."""
    message = {"op": "response", "big": 123456789012345678901234567, "nan": float("nan")}
    frame = encode(message)
    assert len(frame) < 100 and frame[3] & 0x80  # small, with the exact bit
    got, ends, _ = asyncio.run(_read_at_once(frame))
    assert not ends and len(got) == 1
    assert got[0]["big"] == message["big"] and type(got[0]["big"]) is int
    assert math.isnan(got[0]["nan"])


def test_a_handlers_lookup_error_on_a_message_read_at_once_ends_the_channel_with_it() -> None:
    def deliver(message: dict[str, Any]) -> None:
        raise KeyError("batch")

    _, ends, closing = asyncio.run(_read_at_once(encode({"op": "done"}), deliver))
    assert len(ends) == 1 and isinstance(ends[0], KeyError)
    assert closing


def test_a_handlers_bug_on_a_message_read_at_once_is_not_taken_for_a_broken_peer() -> None:
    """A server bug in the handler is the loop's to report (as with any read), not the channel's end."""
    seen: list[dict[str, Any]] = []

    def deliver(message: dict[str, Any]) -> None:
        raise RuntimeError("a server bug")

    async def run() -> list[Exception | None]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: seen.append(context))
        _, ends, _ = await _read_at_once(encode({"op": "done"}), deliver)
        return ends

    ends = asyncio.run(run())
    assert not any(isinstance(end, RuntimeError) for end in ends), ends
    assert any(isinstance(context.get("exception"), RuntimeError) for context in seen), seen
