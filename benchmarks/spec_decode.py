"""Speculative decoding (n-gram prompt lookup, or a draft model) against plain decoding, measured in the same run
on the same prompts: output tok/s on a repetition-heavy workload (rewrite a passage / edit code with one change)
at concurrency 1 and 8, each request ending at the model's end token as a user's would; on the seed workload of
benchmarks.throughput (64 random-token prompts, outputs U[16,192] with ignore_eos, at most 32 sequences, budget
2048); and on a closed batch of 32 random-token prompts with 64 output tokens each, where nothing waits to take
the place of a request that finishes early; acceptance length.
`python -m benchmarks.spec_decode` (SmolLM2, float32, greedy);
`python -m benchmarks.spec_decode --model demo:small --method draft --draft-model demo:small-l2`."""

import argparse
import time

from transformers import AutoTokenizer

from benchmarks.serving import workload
from benchmarks.throughput import workload as seed_workload
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.model_source import resolve_model

PASSAGES = [
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase funding for the library and to reduce spending on travel.",
    "Our store opens at nine in the morning and closes at six in the evening. On weekends we open an hour later, "
    "and on public holidays the store stays closed all day.",
    "The river rises in the northern hills, flows south through three small towns and a wide valley of farms, "
    "and reaches the sea after about two hundred kilometres.",
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
    "    return 2 * (width + height)\n\n\ndef describe(width, height):\n"
    "    return f'{width} by {height}: area {area(width, height)}'\n",
]
EDITS = [
    "Rewrite this passage, replacing 'Tuesday' with 'Friday' and changing nothing else:\n\n{}",
    "Rewrite this passage, replacing 'nine' with 'eight' and changing nothing else:\n\n{}",
    "Rewrite this passage, replacing 'south' with 'east' and changing nothing else:\n\n{}",
    "Rename the function `area` to `rectangle_area` everywhere in this code and change nothing else:\n\n{}",
]


def repetition_prompts(model: str, n: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    out = []
    for i in range(n):
        text = EDITS[i % len(EDITS)].format(PASSAGES[i % len(PASSAGES)])
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def seed_prompts(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """benchmarks.throughput's seed workload: its prompts and output lengths."""
    prompts, params = seed_workload(64, 0, llm.engine.vocab_size)
    return [p["prompt_token_ids"] for p in prompts], [p.max_tokens for p in params]


def run(
    llm: LLM, prompts: list[list[int]], max_tokens: int | list[int], concurrency: int, ignore_eos: bool = False
) -> tuple[float, list[list[int]]]:
    """Output tok/s with at most `concurrency` requests given to the engine at once (batches of that many, back
    to back); `max_tokens`: one for all, or one per prompt."""
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos) for n in lengths]
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = [{"prompt_token_ids": p} for p in prompts[i : i + concurrency]]
        outputs += [o.outputs[0].token_ids for o in llm.generate(batch, params[i : i + concurrency], use_tqdm=False)]
    return sum(map(len, outputs)) / (time.perf_counter() - start), outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="demo:smollm2")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    ap.add_argument("--draft-model", help="method draft: the draft checkpoint (benchmarks/cut_model.py cuts one)")
    ap.add_argument("--cases", default="rep1,rep8,seed,batch32", help="which of rep1, rep8, seed, batch32 to run")
    ap.add_argument("--min-acceptance-rate", type=float, default=0.3, help="the back-off bar (0: never back off)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch-max-tokens", type=int, default=64, help="output tokens of each closed-batch request")
    ap.add_argument("--rounds", type=int, default=3, help="plain and speculative runs alternated per workload")
    args = ap.parse_args()
    opts = dict(dtype="float32", max_num_seqs=32, max_num_batched_tokens=2048, enable_prefix_caching=False)
    plain = LLM(args.model, **opts)
    speculative = {
        "method": args.method,
        "num_speculative_tokens": args.k,
        "min_acceptance_rate": args.min_acceptance_rate,
        **({"model": args.draft_model} if args.method == "draft" else {}),
    }
    spec = LLM(args.model, speculative=speculative, **opts)
    rep = repetition_prompts(args.model, 8)
    seed, seed_lengths = seed_prompts(plain)
    cases = {  # name, prompts, max_tokens, concurrency, ignore_eos
        "rep1": ("repetition, concurrency 1", rep[:2], args.max_tokens, 1, False),
        "rep8": ("repetition, concurrency 8", rep, args.max_tokens, 8, False),
        "seed": ("seed workload, 64 req, 32 seqs", seed, seed_lengths, len(seed), True),
        "batch32": ("closed batch of 32", workload(32, 32, 256, seed=0), args.batch_max_tokens, 32, True),
    }
    cases = [cases[c] for c in args.cases.split(",")]
    for _, prompts, _, conc, _ in cases:  # warm-up: oneDNN primitives of each case's shapes, made once per process
        run(plain, prompts, 8, conc, True), run(spec, prompts, 8, conc, True)
    how = f"draft {args.draft_model}" if args.method == "draft" else "n-gram"
    print(
        f"{args.model} float32, {how} k={args.k}, min_acceptance_rate {args.min_acceptance_rate}, greedy, "
        f"{args.rounds} rounds alternated, best tok/s of each"
    )
    print(
        f"{'workload':30} {'out tok':>7} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} {'per round':>17} "
        f"{'accept len':>10} {'same':>5}"
    )
    for name, prompts, max_tokens, conc, ignore_eos in cases:
        s0 = spec.engine.stats()
        base, fast, same = [], [], True
        for _ in range(args.rounds):
            tps, want = run(plain, prompts, max_tokens, conc, ignore_eos)
            base.append(tps)
            tps, got = run(spec, prompts, max_tokens, conc, ignore_eos)
            fast.append(tps)
            same &= got == want
        s1 = spec.engine.stats()
        drafts = s1.spec_decode_num_drafts - s0.spec_decode_num_drafts
        acc = s1.spec_decode_num_accepted_tokens - s0.spec_decode_num_accepted_tokens
        length = f"{1 + acc / drafts:.2f}" if drafts else "-"
        rounds = "/".join(f"{f / b:.2f}" for b, f in zip(base, fast))
        print(
            f"{name:30} {sum(map(len, want)):7d} {max(base):12.1f} {max(fast):11.1f} {max(fast) / max(base):6.2f} "
            f"{rounds:>17} {length:>10} {str(same):>5}",
            flush=True,
        )


if __name__ == "__main__":
    main()
