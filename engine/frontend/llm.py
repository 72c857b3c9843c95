"""Offline batch generation, vLLM-compatible in shape: LLM(model).generate(prompts, params)."""

import itertools

from tqdm import tqdm

from conveyor.engine.config import EngineConfig
from conveyor.engine.frontend.chat_template import render_chat
from conveyor.engine.frontend.llm_engine import LLMEngine
from conveyor.engine.frontend.outputs import RequestOutput
from conveyor.engine.lora_request import LoRARequest
from conveyor.engine.sampling_params import SamplingParams

Prompt = str | dict


class LLM:
    def __init__(self, model: str = "demo:tiny", engine_core_process: bool = False, **options: object) -> None:
        """engine_core_process: run the scheduler/model loop in a process of its own (detokenising here)."""
        self.engine = LLMEngine(EngineConfig(model=model, **options), engine_core_process=engine_core_process)
        self.engine.stream_outputs = False
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without sampling_params: the checkpoint's generation_config.json defaults."""
        return self.engine.default_sampling_params()

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list):
                raise ValueError("prompt_token_ids must be a list of integers")
            return None, ids
        raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        cache_salt: list[str | None] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """cache_salt (or a prompt dict's "cache_salt" key): prefix-cache hits only among equal salts.
        lora_request: one adapter for every prompt, or one (or None: the base model) per prompt."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if isinstance(sampling_params, list):
            params = sampling_params
        else:
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        priority = priority or [0] * len(prompts)
        salts = cache_salt or [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        if len(salts) != len(prompts) or any(s is not None and not isinstance(s, str) for s in salts):
            raise ValueError(f"cache_salt must be one string or None per prompt ({len(prompts)} prompts)")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        requests = []
        for prompt, p, lora in zip(prompts, params, loras):
            text, ids = self._tokenize(prompt)
            self.engine.validate(ids, p)
            if lora is not None:
                self.engine.add_lora(lora)
            requests.append((text, ids, p))
        order: dict[str, tuple[int, int]] = {}
        for i, ((text, ids, p), prio, salt, lora) in enumerate(zip(requests, priority, salts, loras)):
            for j, sub in enumerate(p.fan_out()):
                rid = str(next(self._ids))
                order[rid] = (i, j)
                self.engine.add_request(
                    rid, ids, sub, priority=prio, prompt=text, cache_salt=salt, validated=True, lora_request=lora
                )
        return self._run(order, len(prompts), use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered with the model's chat template;
        `tools` (OpenAI function specs) go to the template, which must support them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            text = render_chat(self.tokenizer, conv, tools, add_generation_prompt)
            prompts.append({"prompt_token_ids": self.tokenizer(text, add_special_tokens=False).input_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, order: dict[str, tuple[int, int]], num_prompts: int, use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * num_prompts
        bar = tqdm(total=len(order), desc="Generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if not out.finished:
                    continue
                i, j = order[out.request_id]
                out.outputs[0].index = j
                if results[i] is None:
                    out.request_id = str(i)
                    results[i] = out
                else:
                    results[i].outputs.append(out.outputs[0])
                    results[i].outputs.sort(key=lambda c: c.index)
                bar.update(1)
        bar.close()
        return results

    def shutdown(self) -> None:
        self.engine.shutdown()
