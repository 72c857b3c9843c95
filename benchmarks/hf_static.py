"""The transformers peer of benchmarks/throughput.py: its own `generate` with static batching over the same
workload (batches of at most 32 requests in arrival order, left-padded; each batch decodes until its longest
output is done, and only the tokens each request asked for count)."""

import time

import torch
from transformers import AutoModelForCausalLM

from conveyor.engine.sampling_params import SamplingParams

BATCH = 32


def measure_transformers(model_path: str, dtype: str, prompts: list[dict], params: list[SamplingParams]) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
    batches = [list(range(i, min(i + BATCH, len(prompts)))) for i in range(0, len(prompts), BATCH)]
    with torch.inference_mode():
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        for batch in batches:
            ids = [prompts[i]["prompt_token_ids"] for i in batch]
            width = max(map(len, ids))
            input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            new = max(params[i].max_tokens for i in batch)
            model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False
            )
        elapsed = time.perf_counter() - start
    tokens = sum(p.max_tokens for p in params)
    return {"seconds": elapsed, "output_tokens": tokens, "tok_per_s": tokens / elapsed, "steps": 0}
