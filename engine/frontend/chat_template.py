"""Chat messages (and tools) to prompt text through the tokenizer's own chat template."""

from typing import Any

from transformers import PreTrainedTokenizerBase


def supports_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the template renders `tools` at all; one that ignores them would drop them silently."""
    template = tokenizer.chat_template
    templates = template.values() if isinstance(template, dict) else [template or ""]
    return any("tools" in t for t in templates)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """Raises ValueError naming `tools` or `messages` when the template cannot take them."""
    if tools and not supports_tools(tokenizer):
        raise ValueError(
            "tools: this model's chat template has no tool support (serve it with a chat_template that renders `tools`)"
        )
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except Exception as e:
        raise ValueError(f"messages: cannot apply the chat template: {e}") from None
