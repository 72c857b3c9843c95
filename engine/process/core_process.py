"""The engine core's own process: `python -m conveyor.engine.process.core_process IN OUT CONFIG_JSON PARENT_PID THREADS`.
Busy loop: take every queued input, run one step, send the step's deltas and the stats; block only when idle.
It dies with its parent (PR_SET_PDEATHSIG, and a parent-pid check while idle)."""

import ctypes
import json
import os
import signal
import sys
import time
import traceback

import zmq

from conveyor.engine.core.messages import (
    AddRequest,
    Codec,
    CoreFailed,
    CoreOutput,
    CoreOutputs,
    CoreReady,
    FinishRequests,
    ImportRequest,
    Shutdown,
)
from conveyor.engine.process.core_priority import REFRESH_S, CorePriority

IDLE_POLL_MS = 500


def die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass


def serve_core(
    in_addr: str, out_addr: str, options: dict, eos_token_ids: set[int], parent_pid: int, threads: int = 1
) -> None:
    ctx = zmq.Context(1)
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inputs.connect(in_addr)
    outputs.connect(out_addr)
    codec, priority = Codec(), None
    try:
        from conveyor.engine.config import EngineConfig
        from conveyor.engine.core.engine_core import EngineCore
        from conveyor.engine.process.heap import freeze_startup_heap
        from conveyor.engine.resolved_config import resolve

        config = resolve(EngineConfig(**options))
        core = EngineCore(config, eos_token_ids)
        priority = CorePriority(config.core_process_priority, threads)
        priority.refresh()  # after the model: torch's threads exist
        refreshed_at = time.monotonic()
        freeze_startup_heap(core)
        outputs.send(
            codec.encode(
                CoreReady(core.block_manager.num_blocks, core.block_manager.num_swap_blocks, os.getpid(), core.stats())
            )
        )
        poller = zmq.Poller()
        poller.register(inputs, zmq.POLLIN)
        while True:
            if time.monotonic() - refreshed_at >= REFRESH_S:
                priority.refresh()
                refreshed_at = time.monotonic()
            else:
                priority.follow_front()
            if not core.has_unfinished and not poller.poll(IDLE_POLL_MS):
                if os.getppid() != parent_pid:
                    return
                continue
            news: list[CoreOutput] = []
            while True:
                try:
                    msg = codec.decode_input(inputs.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, CoreOutput):
                    news.append(msg)
                elif isinstance(msg, AddRequest):
                    try:
                        core.add_request(msg)
                    except (ValueError, TypeError) as e:
                        news.append(CoreOutput(msg.request_id, [], finish_reason="error", stop_reason=str(e)))
                elif isinstance(msg, ImportRequest):
                    try:
                        core.import_request(msg.request_id, msg.handoff)
                    except (ValueError, TypeError) as e:
                        news.append(CoreOutput(msg.request_id, [], finish_reason="error", stop_reason=str(e)))
                elif isinstance(msg, FinishRequests):
                    news += core.finish_requests(msg.request_ids, msg.reason, msg.stop_reasons or None)
            if core.has_unfinished:
                news += core.step()
            events = core.drain_kv_events()
            outputs.send(codec.encode(CoreOutputs(news, core.stats(), events if len(events) or events.reset else None)))
    except BaseException:
        try:
            outputs.send(codec.encode(CoreFailed(traceback.format_exc())), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        raise
    finally:
        if priority is not None:
            priority.close()
        outputs.close(linger=1000)
        inputs.close(linger=0)
        ctx.term()


def main() -> None:
    die_with_parent()
    in_addr, out_addr, config_json, parent_pid, threads = sys.argv[1:6]
    import torch

    torch.set_num_threads(int(threads))
    config = json.loads(config_json)
    serve_core(in_addr, out_addr, config["options"], set(config["eos_token_ids"]), int(parent_pid), int(threads))


if __name__ == "__main__":
    main()
