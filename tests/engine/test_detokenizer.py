from transformers import AutoTokenizer

from conveyor.engine.checkpoints.model_source import resolve_model
from conveyor.engine.frontend.detokenizer import IncrementalDetokenizer
from conveyor.engine.sampling_params import SamplingParams

TEXT = "naïve café — 東京タワー 🚀🚀 Zürich ok"


def stream(text: str, params: SamplingParams) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    tok = AutoTokenizer.from_pretrained(resolve_model("demo:tiny"))
    ids = tok(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, params)
    seen, stop = [], None
    for i, t in enumerate(ids):
        stop = detok.add(t, i + 1)
        seen.append(detok.visible_text(False))
        if stop:
            break
    return detok, seen, stop


def test_multibyte_utf8_split_across_tokens() -> None:
    detok, seen, _ = stream(TEXT, SamplingParams())
    detok.flush()
    assert detok.text == TEXT
    assert all("\ufffd" not in s for s in seen), "partial UTF-8 sequences must not leak out"
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), "streamed text only grows"


def test_stop_string_inside_multibyte_text_and_holdback() -> None:
    detok, seen, stop = stream(TEXT, SamplingParams(stop=["タワ"]))
    assert stop == "タワ" and detok.text == "naïve café — 東京"
    assert all(not s.endswith("タ") for s in seen), "a possible stop prefix is held back while streaming"


def test_deferred_decode_equals_the_streamed_text() -> None:
    """Offline generate decodes once at the end; it must give the text streaming builds token by token,
    also for random ids (byte pieces, special tokens) and with or without skip_special_tokens."""
    import random

    tok = AutoTokenizer.from_pretrained(resolve_model("demo:tiny"))
    rng = random.Random(0)
    cases = [tok(TEXT, add_special_tokens=False).input_ids] + [
        [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))] for _ in range(40)
    ]
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip)
        for ids in cases:
            streamed, deferred = IncrementalDetokenizer(tok, params), IncrementalDetokenizer(tok, params, deferred=True)
            for i, t in enumerate(ids):
                assert deferred.add(t, i + 1) is None
                streamed.add(t, i + 1)
            assert deferred.text == ""
            streamed.flush()
            deferred.flush()
            assert deferred.text == streamed.text, ids
    assert not IncrementalDetokenizer(tok, SamplingParams(stop=["x"]), deferred=True).deferred
