"""Batched sampling: penalties, logit bias, structured-output token masks, temperature, top-k/top-p/min-p,
per-request seeds, logprobs."""

from dataclasses import dataclass

import torch

from conveyor.engine.sampling_params import SamplingParams


@dataclass
class GrammarBitmask:
    """Packed allowed-token bits (int32 [k, ceil(vocab / 32)], bit j of word w = token 32 w + j) for the
    constrained requests of one step, by request id."""

    req_ids: list[str]
    bits: torch.Tensor

    def rows(self, sampled: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of the sampled batch, their bits) in the runner's sampled order."""
        where = {r: i for i, r in enumerate(sampled)}
        keep = [(where[r], j) for j, r in enumerate(self.req_ids) if r in where]
        rows, src = zip(*keep) if keep else ((), ())
        return (torch.tensor(rows, dtype=torch.long, device=device), self.bits[list(src)].to(device, non_blocking=True))


_BIT = torch.arange(32, dtype=torch.int32)


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
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    mask_rows: torch.Tensor | None = None
    mask_bits: torch.Tensor | None = None

    @property
    def max_logprobs(self) -> int | None:
        wanted = [n for n in self.num_logprobs if n is not None]
        return max(wanted) if wanted else None


def add_constraints(
    b: SamplingBatch,
    params: list[SamplingParams],
    sampled: list[str],
    grammar: GrammarBitmask | None,
    device: torch.device,
) -> SamplingBatch:
    """Adds the per-request logit bias and this step's grammar bitmask to a batch."""
    bias = [(i, t, v) for i, p in enumerate(params) if p.logit_bias for t, v in p.logit_bias.items()]
    if bias:
        rows, toks, vals = zip(*bias)
        b.bias_rows, b.bias_tokens = (torch.tensor(x, dtype=torch.long, device=device) for x in (rows, toks))
        b.bias_values = torch.tensor(vals, dtype=torch.float32, device=device)
    if grammar is not None:
        b.mask_rows, b.mask_bits = grammar.rows(sampled, device)
    return b


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    allowed = ((bits[:, :, None] >> _BIT.to(bits.device)) & 1).reshape(len(rows), -1)[:, :vocab].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


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
    if b.bias_rows is not None:
        logits.index_put_((b.bias_rows, b.bias_tokens), b.bias_values, accumulate=True)
    if b.mask_rows is not None and len(b.mask_rows):
        logits = apply_bitmask(logits, b.mask_rows, b.mask_bits)
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
