"""Conveyor's engine. Names load lazily so light modules (engine.stats, engine.prefix_hash, ...)
can be imported by the HTTP edge and the cluster layer without pulling in torch."""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "AsyncEngine": "conveyor.engine.frontend.async_engine",
    "EngineConfig": "conveyor.engine.config",
    "LLM": "conveyor.engine.frontend.llm",
    "LLMEngine": "conveyor.engine.frontend.llm_engine",
    "CompletionOutput": "conveyor.engine.frontend.outputs",
    "RequestMetrics": "conveyor.engine.frontend.outputs",
    "RequestOutput": "conveyor.engine.frontend.outputs",
    "SamplingParams": "conveyor.engine.sampling_params",
    "EngineStats": "conveyor.engine.stats",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
