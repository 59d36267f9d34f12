"""The proposer the speculative settings name: prompt lookup (``ngram``) or a draft model."""

from __future__ import annotations

from pipeline.config import ServerConfig
from scheduler_proc.model.runner import ModelRunner
from scheduler_proc.speculative.draft_model import DraftModelProposer
from scheduler_proc.speculative.ngram import NgramProposer
from scheduler_proc.speculative.proposer import Drafter, Proposer


def build_drafter(config: ServerConfig, runner: ModelRunner) -> Drafter | None:
    """None when the server does not speculate. A draft model that cannot serve this target
    (another vocabulary, a shorter context, a missing directory) fails the start."""
    spec = config.speculative
    if spec is None:
        return None
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        proposer = DraftModelProposer(config, runner)
    return Drafter(spec, proposer)
