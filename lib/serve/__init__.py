"""Serving many requests on one engine, in nano-vllm's parts: the requests (`trace`), the
settings of each rung of the ladder (`policy`), the scheduler that plans each step
(`scheduler`), the step loop with speculative decoding in the batch (`server`) and what a run
reports (`report`)."""
from lib.serve.policy import LADDER, Policy
from lib.serve.report import Outcome, Report
from lib.serve.server import serve
from lib.serve.trace import Request, make_trace, rejection_reason

__all__ = ["LADDER", "Policy", "Outcome", "Report", "serve", "Request", "make_trace", "rejection_reason"]
