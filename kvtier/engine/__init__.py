"""The reference engine: continuous batching, chunked prefill, a paged model runner over kvtier.

``LLMEngine(model, cache_config, scheduler_config=..., connector=None)``;
``engine.generate(prompts, SamplingParams(...)) -> list[RequestOutput]``.
"""

from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.params import SamplingParams, SchedulerConfig
from kvtier.engine.request import RequestOutput

__all__ = ["LLMEngine", "RequestOutput", "SamplingParams", "SchedulerConfig"]
