"""The peer: vLLM's CPU build on a workload given as JSON, run in vLLM's own venv by
benchmarks/throughput.py --peer-vllm PYTHON. Reads {model, dtype, prompts, max_tokens} on stdin,
prints one JSON line {tok_per_s, seconds, output_tokens, token_ids} after the warm-up the spec gives (benchmarks/throughput.py)."""

import json
import sys
import time


def main() -> None:
    spec = json.load(sys.stdin)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        seed=0,
    )
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=o, min_tokens=o, ignore_eos=True) for o in spec["max_tokens"]]
    warm = spec["warmup"]
    llm.generate(
        [{"prompt_token_ids": ids} for ids in warm["prompts"]],
        [
            SamplingParams(temperature=0, max_tokens=o, min_tokens=o if warm["exact"] else 0, ignore_eos=warm["exact"])
            for o in warm["max_tokens"]
        ],
        use_tqdm=False,
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    tokens = sum(map(len, token_ids))
    import torch

    isa = "avx512" if torch.cpu._is_avx512_supported() else "avx2"  # what vLLM picked its kernels by
    print(
        "PEER_RESULT "
        + json.dumps(
            {
                "tok_per_s": tokens / seconds,
                "seconds": seconds,
                "output_tokens": tokens,
                "token_ids": token_ids,
                "isa": isa,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
