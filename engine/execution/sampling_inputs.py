"""What the sampler needs each step from the model runner's requests: their sampling state, gathered into a
SamplingBatch for the sampled rows."""

from dataclasses import dataclass

import numpy as np
import torch

from conveyor.engine.execution.persistent_batch import PersistentBatch
from conveyor.engine.execution.sampler import SamplingBatch
from conveyor.engine.sampling_params import SamplingParams


@dataclass
class RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    stop_ids: list[int]
    generator: torch.Generator | None


def sampling_batch(
    req_ids: list[str],
    rows: np.ndarray,
    batch: PersistentBatch,
    requests: dict[str, RequestState],
    special: set[str],
    vocab_size: int,
    device: torch.device,
) -> SamplingBatch:
    """The sampler's view of the sampled rows: the persistent batch's sampling columns, plus penalties, seeds,
    min_tokens bans and logprobs of the `special` requests."""
    dev, n, b = device, len(req_ids), batch

    def col(values: np.ndarray, off: float) -> torch.Tensor | None:
        return torch.from_numpy(values).to(dev) if (values != off).any() else None

    temperature, top_k = b.temperature[rows], b.top_k[rows]
    special_rows = [(i, requests[r]) for i, r in enumerate(req_ids) if r in special] if special else []
    penalties = [(i, s) for i, s in special_rows if s.params.has_penalties]
    pen: dict[str, torch.Tensor | None] = dict.fromkeys(
        ("output_counts", "prompt_mask", "repetition_penalty", "frequency_penalty", "presence_penalty")
    )
    if penalties:
        pen["output_counts"] = torch.zeros(n, vocab_size, dtype=torch.float32, device=dev)
        pen["prompt_mask"] = torch.zeros(n, vocab_size, dtype=torch.bool, device=dev)
        for i, s in penalties:
            if s.output_token_ids:
                pen["output_counts"][i].index_add_(
                    0, torch.tensor(s.output_token_ids, device=dev), torch.ones(len(s.output_token_ids), device=dev)
                )
            pen["prompt_mask"][i, torch.tensor(s.prompt_token_ids, device=dev)] = True
        for name, neutral in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
            values = torch.full((n,), neutral, dtype=torch.float32, device=dev)
            for i, s in penalties:
                values[i] = getattr(s.params, name)
            pen[name] = values
        if bool((pen["repetition_penalty"] == 1.0).all()):
            pen["repetition_penalty"] = None
    banned = [(i, tok) for i, s in special_rows if len(s.output_token_ids) < s.params.min_tokens for tok in s.stop_ids]
    banned_rows, banned_tokens = (torch.tensor(x, device=dev) for x in zip(*banned)) if banned else (None, None)
    num_logprobs: list[int | None] = [None] * n
    for i, s in special_rows:
        num_logprobs[i] = s.params.logprobs
    return SamplingBatch(
        temperature=torch.from_numpy(temperature).to(dev),
        all_greedy=bool((temperature < 1e-5).all()),
        top_k=col(top_k, vocab_size),
        top_p=col(b.top_p[rows], 1.0),
        min_p=col(b.min_p[rows], 0.0),
        generators={i: s.generator for i, s in special_rows if s.generator is not None},
        banned_rows=banned_rows,
        banned_tokens=banned_tokens,
        num_logprobs=num_logprobs,
        **pen,
    )
