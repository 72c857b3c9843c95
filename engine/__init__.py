from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

__all__ = ["AsyncEngine", "CompletionOutput", "EngineConfig", "EngineStats", "LLM", "LLMEngine",
           "RequestMetrics", "RequestOutput", "SamplingParams"]
