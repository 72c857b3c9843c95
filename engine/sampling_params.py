import json

import msgspec


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {message}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


FLOAT32_MAX = 3.4028234663852886e38


def _is_num(x: object) -> bool:
    """A finite number that float32 holds: the sampler computes in float32 tensors."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) <= FLOAT32_MAX


class StructuredParams(msgspec.Struct, kw_only=True, dict=True, omit_defaults=True):
    """One output constraint, vLLM's shape: a JSON schema, any JSON object, a regex, a choice, or an EBNF grammar.
    `kind` and `text` (the constraint the grammar compiles) are derived in __post_init__, which msgspec runs on
    construction, decoding, unpickling and structs.replace alike; they are not encoded."""

    json: str | dict | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object is True else []
        _check(
            isinstance(self.json_object, bool), "structured.json_object", f"must be a bool, got {self.json_object!r}"
        )
        _check(
            len(given) == 1,
            "structured",
            f"needs exactly one of json, json_object, regex, choice, grammar; got {given}",
        )
        self.kind = given[0]
        if self.kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    _check(False, "structured.json", f"is not valid JSON: {e}")
            _check(isinstance(schema, (dict, bool)), "structured.json", f"must be a JSON schema object, got {schema!r}")
            self.text = json.dumps(schema)
        elif self.kind == "choice":
            _check(
                isinstance(self.choice, list) and self.choice and all(isinstance(c, str) and c for c in self.choice),
                "structured.choice",
                f"must be a non-empty list of non-empty strings, got {self.choice!r}",
            )
            self.text = json.dumps(self.choice)
        elif self.kind == "json_object":
            self.text = ""
        else:
            value = getattr(self, self.kind)
            _check(
                isinstance(value, str) and value,
                f"structured.{self.kind}",
                f"must be a non-empty string, got {value!r}",
            )
            self.text = value
        from conveyor.engine.core.structured_output import check_constraint

        error = check_constraint(self.kind, self.text)
        _check(error is None, f"structured.{self.kind}", f"is not a valid constraint: {error}")

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.text


class SamplingParams(msgspec.Struct, kw_only=True, dict=True, omit_defaults=True):
    """What a request samples with; validated in __post_init__ (a ValueError naming the field), which msgspec runs
    on construction, decoding, unpickling and structs.replace alike, so every copy is a checked one. `structured`
    accepts a dict of StructuredParams fields too. `stop_strings` (`stop` as a list) is derived, not encoded."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredParams | None = None
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check(_is_num(getattr(self, name)), name, f"must be a finite float32 number, got {getattr(self, name)!r}")
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            _check(_is_int(getattr(self, name)), name, f"must be an integer, got {getattr(self, name)!r}")
        _check(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        _check(
            -2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}"
        )
        _check(self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        _check(self.seed is None or _is_int(self.seed), "seed", f"must be an integer or None, got {self.seed!r}")
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            f"must be None or an integer in [0, 20], got {self.logprobs!r}",
        )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _check(all(isinstance(s, str) and s for s in stop), "stop", f"must be non-empty strings, got {self.stop!r}")
        self.stop_strings = stop
        if self.stop is not None and not isinstance(self.stop, str):
            self.stop = stop
        ids = self.stop_token_ids or []
        _check(
            isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids),
            "stop_token_ids",
            f"must be a list of non-negative integers, got {self.stop_token_ids!r}",
        )
        self.stop_token_ids = list(ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, f"must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.structured, dict):
            self.structured = StructuredParams(**self.structured)
        _check(
            self.structured is None or isinstance(self.structured, StructuredParams),
            "structured",
            f"must be a StructuredParams, a dict of its fields, or None, got {type(self.structured).__name__}",
        )
        if self.structured is not None:
            _check(
                not self.ignore_eos, "ignore_eos", "cannot be combined with structured: the constraint ends the output"
            )
            _check(
                self.min_tokens == 0, "min_tokens", "cannot be combined with structured: the constraint ends the output"
            )
        bias = self.logit_bias or {}
        _check(
            isinstance(bias, dict)
            and all(_is_int(t) and t >= 0 and _is_num(b) and -100 <= b <= 100 for t, b in bias.items()),
            "logit_bias",
            f"must map non-negative token ids to numbers in [-100, 100], got {self.logit_bias!r}",
        )
        self.logit_bias = {t: float(b) for t, b in bias.items()} or None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def fan_out(self) -> list["SamplingParams"]:
        """The n one-sample requests that n > 1 runs as; sample j gets seed + j, so seeded samples differ."""
        if self.n == 1:
            return [self]
        return [
            msgspec.structs.replace(self, n=1, seed=None if self.seed is None else self.seed + j) for j in range(self.n)
        ]
