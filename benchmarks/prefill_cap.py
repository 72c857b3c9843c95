"""Offline: what `max_prefill_tokens_while_decoding` does to the step a decoding stream waits on (its ITL in
the engine), to tok/s and to TTFT. Caps run alternated in rounds on one workload; greedy tokens are compared
with the first cap's.

    python -m benchmarks.prefill_cap --model demo:smollm2 --threads 2 --num-requests 64 --caps 0,256,128
"""

import argparse
import random
import statistics
import time

import torch

from benchmarks.lengths import Lengths, token_prompts
from benchmarks.percentiles import percentile
from conveyor.engine import LLM, SamplingParams


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[dict[str, float], list[list[int]]]:
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.engine.local_core.step_trace.enable()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    records = llm.engine.local_core.step_trace.disable()
    tokens = [o.outputs[0].token_ids for o in outs]
    waits = [r.duration_s for r in records for w in r.work if w.kind == "decode"]
    ttft = statistics.mean(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    return {
        "tok_s": sum(map(len, tokens)) / elapsed,
        "p50": percentile(waits, 0.5),
        "p99": percentile(waits, 0.99),
        "ttft": ttft,
    }, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo:tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--prompt-len", default="uniform:32,256")
    p.add_argument("--output-len", default="uniform:16,192")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--caps", default="0,256,128", help="comma-separated; 0 is off")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    caps = [int(c) for c in args.caps.split(",")]
    llms = {
        c: LLM(
            args.model,
            dtype=args.dtype,
            enable_prefix_caching=False,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_tokens_while_decoding=c,
        )
        for c in caps
    }
    vocab = next(iter(llms.values())).engine.vocab_size
    prompts = token_prompts(Lengths.parse(args.prompt_len), args.num_requests, vocab, rng)
    out_spec = Lengths.parse(args.output_len)
    params = [
        SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
        for n in (out_spec.sample(rng) for _ in prompts)
    ]
    print(
        f"{args.model} {args.dtype}, {args.threads} threads, {args.num_requests} requests, prompts {args.prompt_len}, "
        f"outputs {args.output_len}, {args.max_num_seqs} slots, {args.max_num_batched_tokens}-token budget"
    )
    reference = None
    for r in range(args.rounds):
        for cap in caps:
            m, tokens = run(llms[cap], prompts, params)
            reference = reference or tokens
            print(
                f"round {r} cap {cap:5d}: {m['tok_s']:8.1f} tok/s  decode step p50 {1000 * m['p50']:6.1f} ms "
                f"p99 {1000 * m['p99']:6.1f} ms (p99/p50 {m['p99'] / m['p50']:.2f})  mean TTFT {m['ttft']:.2f} s  "
                f"tokens as cap {caps[0]}: {tokens == reference}",
                flush=True,
            )


if __name__ == "__main__":
    main()
