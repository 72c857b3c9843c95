"""The token channel between replica and router (deployments/token_channel.py) over real ZeroMQ sockets:
one message per event-loop turn per router, chunks in order per request, the handle call's result
and errors. The end-to-end streams of tests/e2e/test_serve_e2e.py run over it too (it is on by default)."""

import asyncio
from typing import Any

import pytest

from conveyor.deployments.token_channel import IDLE_CLOSE_S, TokenInbox, TokenOutbox, follow


async def handle_call(result: Any, delay_s: float = 0.0) -> Any:
    """Stands in for the Serve handle call: its result (the number of chunks sent) or its error."""
    await asyncio.sleep(delay_s)
    if isinstance(result, BaseException):
        raise result
    return result


def chunk(i: int, last: bool = False) -> dict[str, Any]:
    return {
        "deltas": [
            {
                "index": 0,
                "text": f"t{i}",
                "token_ids": [i],
                "logprobs": [{i: -0.5}],
                "finish_reason": "length" if last else None,
            }
        ],
        "last": last,
    }


def test_one_message_per_loop_turn_and_chunks_in_order() -> None:
    async def main() -> tuple[list, list, int]:
        inbox, outbox = TokenInbox(), TokenOutbox()
        qa, qb = inbox.open("a"), inbox.open("b")
        for step in range(5):  # one engine step: both streams' chunks in one loop turn
            outbox.send(inbox.address, "a", chunk(step, last=step == 4))
            outbox.send(inbox.address, "b", chunk(10 + step, last=step == 4))
            assert len(outbox.pending[inbox.address]) == 2
            await asyncio.sleep(0)
            assert not outbox.pending
        got_a = [c async for c in follow(handle_call({"sent": 5}), qa)]
        got_b = [c async for c in follow(handle_call({"sent": 5}), qb)]
        messages = inbox.messages
        inbox.shutdown(), outbox.shutdown()
        return got_a, got_b, messages

    got_a, got_b, messages = asyncio.run(main())
    assert messages == 5
    assert [t for c in got_a for t in c["deltas"][0]["token_ids"]] == [0, 1, 2, 3, 4]
    assert [t for c in got_b for t in c["deltas"][0]["token_ids"]] == [10, 11, 12, 13, 14]
    assert got_a[0]["deltas"][0]["logprobs"][0] == {0: -0.5}
    assert got_a[-1]["last"] and not any(c["last"] for c in got_a[:-1])


def test_handle_call_error_ends_the_stream() -> None:
    async def main() -> list:
        inbox, outbox = TokenInbox(), TokenOutbox()
        queue, got = inbox.open("a"), []
        outbox.send(inbox.address, "a", chunk(0))
        with pytest.raises(RuntimeError, match="replica died"):
            async for c in follow(handle_call(RuntimeError("replica died"), delay_s=0.2), queue):
                got.append(c)
        inbox.shutdown(), outbox.shutdown()
        return got

    assert len(asyncio.run(main())) == 1


def test_chunks_lost_in_transit_end_the_stream_with_an_error() -> None:
    async def main() -> list:
        inbox = TokenInbox()
        queue, got = inbox.open("a"), []
        with pytest.raises(RuntimeError, match="2 of the replica's 2 chunks did not arrive"):
            async for c in follow(handle_call({"sent": 2}), queue, tail_timeout_s=0.2):
                got.append(c)
        inbox.shutdown()
        return got

    assert asyncio.run(main()) == []


def test_closed_request_drops_late_chunks() -> None:
    async def main() -> int:
        inbox, outbox = TokenInbox(), TokenOutbox()
        queue = inbox.open("a")
        inbox.close("a")
        outbox.send(inbox.address, "a", chunk(0))
        b = inbox.open("b")
        outbox.send(inbox.address, "b", chunk(1, last=True))
        got = [c async for c in follow(handle_call({"sent": 1}), b)]
        inbox.shutdown(), outbox.shutdown()
        return queue.qsize() + 10 * len(got)

    assert asyncio.run(main()) == 10


def test_a_backlog_leaves_as_one_merged_chunk_with_the_firsts_ttft_split() -> None:
    async def main() -> list:
        inbox, outbox = TokenInbox(), TokenOutbox()
        queue = inbox.open("a")
        for step in range(4):
            first = {"first_s": 0.01, "ingress_s": 0.002, "replica": "r"} if step == 0 else {}
            outbox.send(inbox.address, "a", {**chunk(step, last=step == 3), **first, "emitted_at": float(step)})
            await asyncio.sleep(0)
        while queue.qsize() < 4:
            await asyncio.sleep(0.01)
        got = [c async for c in follow(handle_call({"sent": 4}), queue)]
        inbox.shutdown(), outbox.shutdown()
        return got

    got = asyncio.run(main())
    assert len(got) == 1 and got[0]["last"] and got[0]["emitted_at"] == 3.0
    assert (got[0]["first_s"], got[0]["ingress_s"], got[0]["replica"]) == (0.01, 0.002, "r")  # the first's TTFT split
    assert got[0]["deltas"] == [
        {
            "index": 0,
            "text": "t0t1t2t3",
            "token_ids": [0, 1, 2, 3],
            "logprobs": [{0: -0.5}, {1: -0.5}, {2: -0.5}, {3: -0.5}],
            "finish_reason": "length",
        }
    ]


def test_an_unreadable_message_is_skipped() -> None:
    async def main() -> list:
        import zmq

        inbox = TokenInbox()
        queue = inbox.open("a")
        rogue = zmq.Context.instance().socket(zmq.PUSH)
        rogue.connect(inbox.address)
        rogue.send(b"\xc1 not msgpack")
        rogue.send(b"\x93\x01\x02\x03")  # msgpack, but not a list of (request id, chunk) pairs
        outbox = TokenOutbox()
        outbox.send(inbox.address, "a", chunk(7, last=True))
        got = [c async for c in follow(handle_call({"sent": 1}), queue)]
        rogue.close(0)
        inbox.shutdown(), outbox.shutdown()
        return got

    got = asyncio.run(main())
    assert [c["deltas"][0]["token_ids"] for c in got] == [[7]]


def test_an_idle_routers_socket_is_closed_and_a_live_one_reconnects() -> None:
    async def main() -> tuple[set, set, list[int]]:
        now = [0.0]
        inbox_a, inbox_b, outbox = TokenInbox(), TokenInbox(), TokenOutbox(clock=lambda: now[0])
        qa, _ = inbox_a.open("a"), inbox_b.open("b")
        outbox.send(inbox_a.address, "a", chunk(0))
        outbox.send(inbox_b.address, "b", chunk(0))
        await asyncio.sleep(0)
        got = [(await asyncio.wait_for(qa.get(), 5))["deltas"][0]["token_ids"][0]]
        for t, token in ((IDLE_CLOSE_S / 2, 1), (IDLE_CLOSE_S + 1, 2)):  # b stays in use, a falls idle
            now[0] = t
            outbox.send(inbox_b.address, "b", chunk(token))
            await asyncio.sleep(0)
        after_idle = set(outbox.sockets)
        outbox.send(inbox_a.address, "a", chunk(1, last=True))
        await asyncio.sleep(0)
        got.append((await asyncio.wait_for(qa.get(), 5))["deltas"][0]["token_ids"][0])
        reconnected = set(outbox.sockets)
        inbox_a.shutdown(), inbox_b.shutdown(), outbox.shutdown()
        return after_idle, reconnected, got

    after_idle, reconnected, got = asyncio.run(main())
    assert len(after_idle) == 1 and len(reconnected) == 2, "a's socket closed after IDLE_CLOSE_S, reopened on use"
    assert got == [0, 1]
