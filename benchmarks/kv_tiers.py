"""The KV tier for the prefix cache on a multi-turn chat whose live prefixes outgrow the pool
(python -m benchmarks.kv_tiers).

N conversations take turns (round-robin, one request at a time): each turn's prompt is the conversation's whole
history (a shared-length system prompt, earlier user turns and replies) plus a new user turn. The pool holds a
fraction of the live histories, so without a tier each turn recomputes its history; with one (`--tier host`
or `disk`) the evicted blocks come back from the tier. Same process, same workload, both runs; reports TTFT
p50/p90, prompt tokens computed, tier hits and load time, the median step time of decode-only steps (tier
stores run beside the forward on a copy thread), and checks that greedy tokens are identical."""

import argparse
import random
import tempfile
import time

import torch

from benchmarks.percentiles import percentile
from conveyor.engine import LLM, SamplingParams


def conversations(n: int, rounds: int, system_len: int, user_len: int, vocab: int, seed: int) -> list:
    rng = random.Random(seed)
    return [
        [[rng.randrange(4, vocab) for _ in range(system_len + user_len if r == 0 else user_len)] for r in range(rounds)]
        for _ in range(n)
    ]


def run(args: argparse.Namespace, convs: list, offload: dict | None) -> dict:
    llm = LLM(
        args.model,
        dtype="float32",
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_offload=offload,
    )
    core = llm.engine.local_core
    params = SamplingParams(temperature=0, max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True)
    warm = [random.Random(1).randrange(4, 100) for _ in range(args.system_len)]
    llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
    prefill0, hits0 = core.num_prefill_tokens, core.block_manager.hits
    core.step_trace.enable()
    history = [[] for _ in convs]
    ttft, outputs, live = [], [], 0
    start = time.perf_counter()
    for r in range(args.rounds):
        for i, conv in enumerate(convs):
            prompt = history[i] + conv[r]
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
            history[i] = prompt + list(out.outputs[0].token_ids)
            outputs.append(list(out.outputs[0].token_ids))
    elapsed = time.perf_counter() - start
    records = core.step_trace.disable()
    live = sum(len(h) for h in history) // args.block_size
    decode = [rec.duration_s for rec in records if rec.tokens("prefill") == 0 and rec.tokens() > 0]
    tiers = core.block_manager.tiers
    result = {
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p90": percentile(ttft, 0.9),
        "prefill_tokens": core.num_prefill_tokens - prefill0,
        "cache_hit_tokens": core.block_manager.hits - hits0,
        "decode_step_p50": percentile(decode, 0.5) if decode else float("nan"),
        "elapsed": elapsed,
        "live_blocks": live,
        "outputs": outputs,
        "tiers": {},
    }
    if tiers is not None:
        result["tiers"] = {t.name: (t.num_slots, t.stats.hits, t.stats.stored) for t in tiers.tiers}
        result["load_ms_per_block"] = 1e3 * core.load_cost.load_s / max(core.load_cost.num_loads, 1)
        result["load_cost"] = core.load_cost.ratio
    llm.engine.shutdown()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo:smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--conversations", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system-len", type=int, default=192)
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=24)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--tier", choices=("host", "disk"), default="host")
    p.add_argument("--tier-gib", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    vocab = 1000
    convs = conversations(args.conversations, args.rounds, args.system_len, args.user_len, vocab, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        offload = {"host_gib": args.tier_gib} if args.tier == "host" else {"disk_path": tmp, "disk_gib": args.tier_gib}
        base = run(args, convs, None)
        tier = run(args, convs, offload)
    print(
        f"model {args.model}, {args.threads} thread(s): {args.conversations} conversations x {args.rounds} rounds, "
        f"system {args.system_len} + user {args.user_len} tokens a turn, {args.output_len} out; pool "
        f"{args.num_blocks} blocks of {args.block_size}; live prefixes at the end {tier['live_blocks']} blocks "
        f"({tier['live_blocks'] / args.num_blocks:.1f}x the pool); tier {args.tier}"
    )
    print()
    print(
        "| run | TTFT p50 ms | TTFT p90 ms | prompt tokens computed | cache-hit tokens | decode step p50 ms | wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in (("no tier", base), (f"{args.tier} tier", tier)):
        print(
            f"| {name} | {1e3 * r['ttft_p50']:.1f} | {1e3 * r['ttft_p90']:.1f} | {r['prefill_tokens']} | "
            f"{r['cache_hit_tokens']} | {1e3 * r['decode_step_p50']:.2f} | {r['elapsed']:.2f} |"
        )
    print()
    print(
        f"TTFT p50 {base['ttft_p50'] / tier['ttft_p50']:.2f}x better; prompt tokens computed "
        f"{base['prefill_tokens'] / max(tier['prefill_tokens'], 1):.2f}x fewer; decode step p50 "
        f"{tier['decode_step_p50'] / base['decode_step_p50']:.2f}x; tier (slots, hits, stored) {tier['tiers']}; "
        f"load {tier['load_ms_per_block']:.3f} ms a block, load/prefill cost {tier['load_cost']:.4f}; "
        f"tokens identical: {base['outputs'] == tier['outputs']}"
    )


if __name__ == "__main__":
    main()
