"""Verification of draft tokens. A drafting request's chunk is [last token, d_1 .. d_k]; its k + 1 logits rows
give the target distributions p_1 .. p_{k+1} of the tokens after each prefix. Speculative sampling (Leviathan
et al. 2023) accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)), stops at the first rejection and emits a
token from the residual max(0, p_i - q_i) (normalised) there, or a bonus token from p_{k+1} when all k pass:
each emitted token is distributed as non-speculative sampling would have it.

Point-mass drafts (q_i = one-hot(d_i): n-gram lookup, a greedy draft model) make this a comparison: sample
t_i ~ p_i with the sampler, accept while t_i == d_i. Then P(accept) = p_i(d_i), and a rejected position emits
t_i ~ p_i conditioned on t_i != d_i, which is the normalised residual. Greedy rows sample the argmax, so greedy
speculation emits exactly the non-speculative tokens. Drafts with a distribution q (a sampling draft model,
EAGLE) would need the general acceptance test and residual sampling, which are not implemented."""

from conveyor.engine.execution.persistent_batch import PersistentBatch
from conveyor.engine.stats import cdiv
from conveyor.engine.step import ScheduledChunk


def verify(sampled: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """`sampled`: the tokens the sampler drew from the k + 1 rows of one point-mass-drafting request. Returns the
    accepted drafts and the token emitted after them."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return drafts[:n], sampled[n]


def fold_drafts(
    chunks: list[ScheduledChunk],
    drafts: dict[str, list[int]],
    rows: list[str],
    tokens: list[int],
    logprobs: list | None,
    batch: PersistentBatch,
    block_size: int,
) -> tuple[list[str], list[int], list | None, dict[str, list[int]]]:
    """Folds each drafting request's k + 1 sampled rows into its accepted drafts and next token; its block
    table row shrinks to the blocks of its computed tokens, as the scheduler's does (BlockManager.roll_back)."""
    starts = {c.req_id: c.start for c in chunks if c.req_id in drafts}
    out_ids, out_tokens, out_lp, accepted = [], [], [], {}
    i = 0
    while i < len(rows):
        rid = rows[i]
        d = drafts.get(rid)
        if d is None:
            out_ids.append(rid)
            out_tokens.append(tokens[i])
            out_lp.append(logprobs[i] if logprobs else None)
            i += 1
            continue
        accepted[rid], token = verify(tokens[i : i + len(d) + 1], d)
        out_ids.append(rid)
        out_tokens.append(token)
        out_lp.append(None)
        batch.num_blocks[batch.rows[rid]] = cdiv(starts[rid] + 1 + len(accepted[rid]), block_size)
        i += len(d) + 1
    return out_ids, out_tokens, out_lp if logprobs else None, accepted
