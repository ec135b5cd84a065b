"""ZmqStageClientBase over real ZMQ sockets: a send that the socket's closing cuts off."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from omni_runtime.engine.stage.stage_core_client import StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import (
    StageServerOutputs,
    StageServerRequest,
)
from omni_runtime.engine.stage.zmq_stage_client import ZmqStageClientBase


class _Client(ZmqStageClientBase[StageServerOutputs]):
    request_type = StageServerRequest
    outputs_type = StageServerOutputs


def _blocked_client(context: zmq.asyncio.Context) -> tuple[_Client, zmq.asyncio.Socket]:
    """A client whose sends wait: its PUSH socket has no peer to take them."""
    send = context.socket(zmq.PUSH)
    send.setsockopt(zmq.LINGER, 0)
    recv = context.socket(zmq.PULL)
    recv.setsockopt(zmq.LINGER, 0)
    client = _Client(send, recv, describe_death=lambda why: f"gone: {why}", name="test")
    return client, recv


async def test_a_send_cut_off_by_the_socket_closing_says_the_replica_is_gone() -> None:
    context = zmq.asyncio.Context()
    client, recv = _blocked_client(context)
    try:
        send = asyncio.create_task(client.add_request_async(StageServerRequest("r")))
        await asyncio.sleep(0)  # one turn of the loop: the task starts its send, which waits
        assert not send.done()
        # As an eviction does: the socket closes under the waiting send.
        client._send_socket.close()
        with pytest.raises(StageCoreDeadError, match="closed while sending"):
            await asyncio.wait_for(send, 5)
    finally:
        client.shutdown()
        recv.close()
        context.term()


async def test_a_cancelled_caller_is_still_cancelled() -> None:
    context = zmq.asyncio.Context()
    client, recv = _blocked_client(context)
    try:
        send = asyncio.create_task(client.add_request_async(StageServerRequest("r")))
        await asyncio.sleep(0)  # one turn of the loop: the task starts its send
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        client.check_health()  # the caller went away; the replica did not
    finally:
        client.shutdown()
        client._send_socket.close()
        recv.close()
        context.term()
