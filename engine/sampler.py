"""Batched sampling: penalties, temperature, top-k/top-p/min-p, per-request seeds, logprobs."""
from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor
    all_greedy: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    repetition_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None
    prompt_mask: torch.Tensor | None
    banned_rows: torch.Tensor | None
    banned_tokens: torch.Tensor | None
    num_logprobs: list[int | None]

    @property
    def max_logprobs(self) -> int | None:
        wanted = [n for n in self.num_logprobs if n is not None]
        return max(wanted) if wanted else None


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    counts = b.output_counts
    if b.repetition_penalty is not None:
        seen = b.prompt_mask | (counts > 0)
        rp = b.repetition_penalty[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if b.frequency_penalty is not None:
        logits = logits - b.frequency_penalty[:, None] * counts - b.presence_penalty[:, None] * (counts > 0)
    return logits


def truncate(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.top_k is None and b.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if b.top_k is not None:
        rank = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= b.top_k[:, None], float("-inf"))
    if b.top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before > b.top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, list[dict[int, float]] | None]:
    logits = logits.float()
    logprobs = logits.log_softmax(dim=-1) if b.max_logprobs is not None else None
    if b.banned_rows is not None:
        logits[b.banned_rows, b.banned_tokens] = float("-inf")
    if b.output_counts is not None:
        logits = apply_penalties(logits, b)
    tokens = logits.argmax(dim=-1)
    if not b.all_greedy:
        greedy = b.temperature < 1e-5
        scaled = logits / torch.where(greedy, 1.0, b.temperature)[:, None]
        probs = truncate(scaled, b).softmax(dim=-1)
        if b.min_p is not None:
            floor = b.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = torch.empty_like(probs).exponential_()
        for row, gen in b.generators.items():
            noise[row].exponential_(generator=gen)
        tokens = torch.where(greedy, tokens, (probs / noise).argmax(dim=-1))
    return tokens, _logprobs(logprobs, tokens, b) if logprobs is not None else None


def _logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, b: SamplingBatch) -> list[dict[int, float] | None]:
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
    top_vals, top_ids = logprobs.topk(b.max_logprobs, dim=-1)
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[dict[int, float] | None] = []
    for i, (tok, n) in enumerate(zip(tokens.tolist(), b.num_logprobs)):
        if n is None:
            out.append(None)
            continue
        entry = dict(zip(top_ids[i][:n], top_vals[i][:n]))
        entry[tok] = chosen[i]
        out.append(entry)
    return out
