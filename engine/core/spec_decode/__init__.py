"""Speculative decoding's scheduler side: proposers guess a decoding request's next tokens, the controller
decides per request and step whether to speculate and keeps the acceptance counters. Verification runs in
the model runner (engine/execution/rejection_sampler.py)."""

from conveyor.engine.core.spec_decode.controller import SpecController

__all__ = ["SpecController"]
