import gc
import weakref


def freeze_startup_heap(owner: object) -> None:
    """Moves everything alive after start-up (torch, transformers, the model: ~300k objects) out of the
    collector's reach, as vLLM's EngineCore does (gc.freeze). Measured with the null model at 256 sequences:
    each full collection scanned them for 0.14-0.8 s, about once per 200 steps. When `owner` is collected the
    heap is unfrozen: start-up objects in reference cycles (the tokenizer's) become collectable again instead of
    outliving an engine that was dropped."""
    gc.collect()
    gc.freeze()
    weakref.finalize(owner, gc.unfreeze)
