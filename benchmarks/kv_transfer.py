"""Moving one request's KV between two replica processes (prefill -> decode), three ways, on this machine:
object_store: the prefill actor ray.put()s the KVHandoff, the decode actor fetches it by reference (the app's
transfer); via_caller: the KVHandoff is the prefill call's result and the decode call's argument (through the
router's process); gloo: torch.distributed send/recv between the two processes (NCCL's counterpart on GPU).
Sizes are real handoffs' bytes: 2 (K, V) x layers x tokens x kv_heads x head_dim x 4 (float32).

    python -m benchmarks.kv_transfer [--tokens 128 512 2048] [--repeats 5]"""

import argparse
import os
import statistics
import time

import ray
import torch

MODELS = {"demo:small": (12, 4, 64), "demo:smollm2": (30, 3, 64)}  # layers, kv heads, head dim


def kv_bytes(model: str, tokens: int, block_size: int = 16) -> int:
    layers, heads, dim = MODELS[model]
    return 2 * layers * -(-tokens // block_size) * block_size * heads * dim * 4


@ray.remote(num_cpus=0)
class Side:
    def __init__(self, rank: int, port: int) -> None:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        self.rank = rank

    def join(self) -> None:
        torch.distributed.init_process_group("gloo", rank=self.rank, world_size=2)

    def handoff(self, n: int) -> object:
        from conveyor.engine.core.kv_handoff import KVHandoff

        return KVHandoff("r", [1], [2], None, bytes(n), [n // 4], "float32")

    def put(self, n: int) -> list:
        return [ray.put(self.handoff(n))]

    def get(self, refs: list) -> float:
        h = ray.get(refs[0])
        return float(h.kv_tensor().sum())

    def take(self, h: object) -> float:
        return float(h.kv_tensor().sum())

    def send(self, n: int) -> None:
        torch.distributed.send(torch.zeros(n // 4), dst=1)

    def recv(self, n: int) -> float:
        t = torch.empty(n // 4)
        torch.distributed.recv(t, src=0)
        return float(t.sum())


def timed(fn: object, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=512 * 2**20)
    port = 29500 + os.getpid() % 1000
    a, b = Side.remote(0, port), Side.remote(1, port)
    ray.get([a.join.remote(), b.join.remote()])
    print("| model | prompt tokens | KV bytes | object_store ms | via_caller ms | gloo ms |")
    print("|---|---|---|---|---|---|")
    for model in args.models:
        for tokens in args.tokens:
            n = kv_bytes(model, tokens)
            store = timed(lambda: ray.get(b.get.remote(a.put.remote(n))), args.repeats)
            caller = timed(lambda: ray.get(b.take.remote(ray.get(a.handoff.remote(n)))), args.repeats)
            gloo = timed(lambda: ray.get([a.send.remote(n), b.recv.remote(n)]), args.repeats)
            print(f"| {model} | {tokens} | {n / 2**20:.1f} MiB | {store:.1f} | {caller:.1f} | {gloo:.1f} |")
    ray.shutdown()


if __name__ == "__main__":
    main()
