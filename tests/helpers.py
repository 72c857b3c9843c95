import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.model_source import resolve_model

PROMPTS = [
    "def",
    "import os\nimport sys\nfrom collections import OrderedDict\n",
    'class Parser:\n    """Parse a configuration file into sections."""\n\n    def __init__(self, path, strict=True):\n',
    "The quick brown fox jumps over the lazy dog. " * 6,
    "for i in range(10):\n    print(i * i)\n",
]


def prompt_ids(model: str, prompts: list[str] = PROMPTS) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    return [tok(p).input_ids for p in prompts]


def hf_greedy(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own generate on the same checkpoint: the correctness oracle."""
    return generate_greedy(
        AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32), prompts, max_tokens
    )


def generate_greedy(hf: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """`max_tokens` greedy tokens per prompt from a transformers (or peft) model's generate."""
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = hf.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=3,
            )
            out.append(y[0, len(ids) :].tolist())
    return out


def engine_greedy(
    model: str, prompts: list[list[int]], max_tokens: int, **options: object
) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, dtype="float32", **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.local_core.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_count == 0 for b in kv.pool.blocks)
    assert not kv.tables
