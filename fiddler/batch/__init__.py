"""Continuous batching: many requests at once on one engine (fiddler.batch.engine.BatchEngine)."""

from .engine import BatchEngine, StepStats, eos_token_ids
from .request import QueueFull, Request, SamplingParams

__all__ = ["BatchEngine", "QueueFull", "Request", "SamplingParams", "StepStats", "eos_token_ids"]
