"""Token-length distributions and synthetic prompts for the bench commands.

A spec is `KIND:ARGS`: `fixed:N`, `uniform:LO,HI`, `heavy-tail:LO,HI[,ALPHA]` (Pareto with exponent ALPHA,
default 1.2, from LO, clipped at HI: most requests short, a few very long), `shared-prefix:PREFIX,SUFFIX`
(prompts only: every prompt starts with the same PREFIX tokens, then SUFFIX unique ones)."""

import random
from dataclasses import dataclass

KINDS = ("fixed", "uniform", "heavy-tail", "shared-prefix")


@dataclass(frozen=True)
class Lengths:
    kind: str
    lo: int
    hi: int
    alpha: float = 1.2

    @classmethod
    def parse(cls, spec: str, what: str = "length") -> "Lengths":
        kind, _, args = spec.partition(":")
        try:
            nums = [float(x) for x in args.split(",")] if args else []
        except ValueError:
            raise ValueError(f"{what}: {spec!r}: arguments must be numbers") from None
        want = {"fixed": (1, 1), "uniform": (2, 2), "heavy-tail": (2, 3), "shared-prefix": (2, 2)}
        if kind not in want:
            raise ValueError(f"{what}: {spec!r}: kind must be one of {', '.join(KINDS)}")
        lo_n, hi_n = want[kind]
        if not lo_n <= len(nums) <= hi_n:
            raise ValueError(f"{what}: {spec!r}: {kind} takes {lo_n if lo_n == hi_n else f'{lo_n}-{hi_n}'} numbers")
        if any(x < (0 if kind == "shared-prefix" else 1) for x in nums[:2]):
            raise ValueError(f"{what}: {spec!r}: lengths must be >= 1")
        if kind == "fixed":
            return cls(kind, int(nums[0]), int(nums[0]))
        if kind in ("uniform", "heavy-tail") and nums[1] < nums[0]:
            raise ValueError(f"{what}: {spec!r}: HI must be >= LO")
        if kind == "heavy-tail" and len(nums) == 3 and nums[2] <= 0:
            raise ValueError(f"{what}: {spec!r}: ALPHA must be > 0")
        return cls(kind, int(nums[0]), int(nums[1]), nums[2] if len(nums) == 3 else 1.2)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.lo
        if self.kind == "uniform":
            return rng.randint(self.lo, self.hi)
        if self.kind == "heavy-tail":
            return min(self.hi, int(self.lo * rng.paretovariate(self.alpha)))
        return self.lo + self.hi

    @property
    def mean_hint(self) -> float:
        return (self.lo + self.hi) / 2 if self.kind != "shared-prefix" else self.lo + self.hi


def token_prompts(spec: Lengths, n: int, vocab: int, rng: random.Random, low: int = 4) -> list[list[int]]:
    """n prompts of random token ids in [low, vocab); shared-prefix ones share their first `spec.lo` ids."""
    prefix = [rng.randrange(low, vocab) for _ in range(spec.lo)] if spec.kind == "shared-prefix" else []
    unique = spec.hi if spec.kind == "shared-prefix" else None
    return [
        prefix + [rng.randrange(low, vocab) for _ in range(unique if unique is not None else spec.sample(rng))]
        for _ in range(n)
    ]


WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue side "
    "kind head house service friend father power hour game line end member law car city community name"
).split()


def text_prompts(spec: Lengths, n: int, rng: random.Random) -> list[str]:
    """n prompts of random common words, about one token per word for BPE tokenizers."""
    return [" ".join(WORDS[i] for i in ids) for ids in token_prompts(spec, n, len(WORDS), rng, 0)]
