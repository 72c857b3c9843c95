"""An OpenAI request made into what the engine runs: the adapter its `model` names, its prompts as token ids
(through the chat template and tools for a chat), and its sampling parameters with the model's generation
defaults, checked against the model's context length and the replicas' limits. Bad input raises APIError 400
naming the field."""

import uuid
from typing import Any

from transformers import PreTrainedTokenizerFast

from conveyor.deployments.api_error import APIError
from conveyor.deployments.protocol import GenerateRequest, LoRAModule
from conveyor.deployments.replica_errors import param_of
from conveyor.deployments.request_models import ChatCompletionRequest, SamplingRequest
from conveyor.deployments.tool_parsers import TOOL_PARSERS
from conveyor.engine import SamplingParams
from conveyor.engine.frontend.chat_template import render_chat
from conveyor.engine.frontend.generation_defaults import SAMPLING_KEYS, load_generation_defaults
from conveyor.engine.frontend.limits import RequestLimits
from conveyor.engine.sampling_params import StructuredParams


class Preprocessor:
    def __init__(
        self,
        model_path: str,
        model_name: str,
        chat_template: str | None,
        tool_call_parser: str,
        lora_modules: tuple[LoRAModule, ...],
    ) -> None:
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)  # AutoTokenizer would import torch
        self.generation_defaults = load_generation_defaults(model_path)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        self.tool_parser = TOOL_PARSERS[tool_call_parser]()
        self.model_name = model_name
        # LoRA adapters by name (the request's `model`): the app's lora_modules, then this router's loads
        self.loras = {m.name: m for m in lora_modules}

    def check_model(self, model: str | None) -> LoRAModule | None:
        """The adapter `model` names (None: the base model); a 404 for a name served by neither."""
        if model is None or model == self.model_name:
            return None
        if model in self.loras:
            return self.loras[model]
        raise APIError(
            f"The model `{model}` does not exist.",
            status=404,
            param="model",
            type="not_found_error",
            code="model_not_found",
        )

    def decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def tokenize_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        return [self.tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompt]

    def chat_prompt(
        self, req: ChatCompletionRequest, structured: tuple[str, dict[str, Any]] | None
    ) -> tuple[list[list[int]], tuple[str, dict[str, Any]] | None, Any]:
        """Prompt ids through the chat template (with tools), the output constraint (a forced tool choice
        constrains to one call), and the tool parser for the output (None without tools)."""
        forced = req.forced_tools()
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.uses_tools() else None
        try:
            text = render_chat(self.tokenizer, [m.render() for m in req.messages], tools, req.add_generation_prompt)
        except ValueError as e:
            raise APIError(str(e), param=str(e).split(":")[0]) from None
        if forced:
            if structured is not None:
                raise APIError(
                    f"tool_choice {req.tool_choice!r} constrains the output; it cannot be combined with "
                    f"{structured[0]}",
                    param="tool_choice",
                )
            structured = ("tool_choice", {"grammar": self.tool_parser.forced_grammar(forced)})
        prompts = [self.tokenizer(text, add_special_tokens=False).input_ids]
        return prompts, structured, self.tool_parser if tools else None

    def prepare(
        self,
        info: dict[str, Any],
        req: SamplingRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        where: str,
        structured: tuple[str, dict[str, Any]] | None = None,
    ) -> GenerateRequest:
        """`info`: the replicas' (LLMReplica.info): max_model_len and the request limits."""
        limit = info["max_model_len"]
        for ids in prompts:
            if not ids:
                raise APIError(f"{where} must not be empty", param=where)
            need = len(ids) + (max_tokens or 1)
            if len(ids) >= limit or need > limit:
                raise APIError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{need} tokens ({len(ids)} in the {where}, {need - len(ids)} in the completion, "
                    f"max_tokens). Please reduce the length of the {where} or completion.",
                    param=where if len(ids) >= limit else "max_tokens",
                )
        sampling = self.generation_defaults.apply(
            req.sampling(max_tokens or limit - max(len(p) for p in prompts)), set(SAMPLING_KEYS) - req.model_fields_set
        )
        if structured is not None:
            field, fields = structured
            try:
                sampling["structured"] = StructuredParams(**fields)
            except (ValueError, TypeError) as e:
                raise APIError(f"{field}: {e}", param=field) from None
        try:
            sp, limits = SamplingParams(**sampling), RequestLimits(**info["limits"])
            for ids in prompts:
                limits.check(ids, sp)
        except (ValueError, TypeError) as e:
            param = param_of(str(e))
            raise APIError(str(e), param=where if param == "prompt" else param) from None
        return GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompts=prompts,
            n=req.n,
            sampling=sp,
            priority=req.priority,
            stream=req.stream,
            cache_salt=req.cache_salt,
        )
