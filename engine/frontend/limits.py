"""What one engine accepts: the checks a request passes once, where it enters (the HTTP router, AsyncEngine,
or LLMEngine offline). Light on purpose (no torch): the router imports it."""

from dataclasses import dataclass

from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.stats import cdiv


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises a ValueError naming the field a request breaks."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[0]!r} is outside the vocabulary [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt is {n} tokens, max_model_len is {self.max_model_len} "
                f"(the prompt must leave room for at least one generated token)"
            )
        if cdiv(n, self.block_size) > self.num_blocks:
            raise ValueError(
                f"the prompt needs {cdiv(n, self.block_size)} KV-cache blocks but the cache holds {self.num_blocks}"
            )
        need = cdiv(min(n + params.max_tokens, self.max_model_len), self.block_size)
        if need > self.num_blocks:
            raise ValueError(
                f"prompt + max_tokens ({n} + {params.max_tokens}) needs {need} KV blocks but the "
                f"cache holds {self.num_blocks}"
            )
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < vocab size {vocab}")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(
                f"SamplingParams.logit_bias token ids must be < vocab size {vocab}, got {max(params.logit_bias)}"
            )
