"""A checkpoint's generation_config.json: sampling defaults for requests that leave them unset, and its eos ids."""

import json
from dataclasses import dataclass, field
from pathlib import Path

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, float | int] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()

    def apply(self, request: dict[str, object], unset: set[str]) -> dict[str, object]:
        """`request` (SamplingParams keyword arguments) with the defaults filled into the `unset` keys."""
        return {**request, **{k: v for k, v in self.sampling.items() if k in unset}}


def load_generation_defaults(model_path: str | Path) -> GenerationDefaults:
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return GenerationDefaults()
    try:
        cfg = json.loads(path.read_text("utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"model: {path} is not valid JSON: {e}") from None
    sampling = {k: cfg[k] for k in SAMPLING_KEYS if cfg.get(k) is not None}
    if sampling.get("top_k") == 0:
        sampling["top_k"] = -1
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    return GenerationDefaults(sampling, tuple(int(t) for t in eos))
