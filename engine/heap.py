import gc


def freeze_startup_heap() -> None:
    """Moves everything alive after start-up (torch, transformers, the model: ~300k objects) out of the
    collector's reach, as vLLM's EngineCore does (gc.freeze). Measured with the null model at 256 sequences:
    each full collection scanned them for 0.14-0.8 s, about once per 200 steps."""
    gc.collect()
    gc.freeze()
