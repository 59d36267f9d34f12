"""New weights from disk while the server runs (``/update_weights_from_disk``): a checkpoint
is read and checked on its own thread into tensors beside the served ones, so the scheduler
keeps stepping meanwhile; the swap, a copy into the served parameters between two steps, is
the only part that holds a step up. A checkpoint of another architecture, config or shape
fails the read with the reason, and nothing served changes."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from pipeline.model_config import ModelConfig
from scheduler_proc.model.llama import LlamaForCausalLM
from scheduler_proc.model.weights import checked_tensors, checkpoint_files, read_config

# The parameters' new values by name, on the served device in the served dtype.
StagedWeights = dict[str, torch.Tensor]


class WeightStager:
    """Reads checkpoints for one model, one at a time, on a thread of its own."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self._model = model
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="weight-update")

    def start(self, model_path: str) -> Future[StagedWeights]:
        """Begins reading ``model_path``; the future holds the staged weights, or the
        ValueError or OSError that says why they cannot be served."""
        return self._thread.submit(stage_checkpoint, self._model, Path(model_path))

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


def stage_checkpoint(model: LlamaForCausalLM, model_dir: Path) -> StagedWeights:
    """Every parameter of ``model`` read from the checkpoint in ``model_dir``, checked
    against the served model's config and shapes, converted to its dtype and device."""
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model_path {str(model_dir)!r} is not a directory")
    served: ModelConfig = model.config
    try:
        config = ModelConfig.from_hf_dict(read_config(model_dir))
    except (TypeError, KeyError) as exc:
        raise ValueError(f"{model_dir / 'config.json'}: {exc}") from exc
    differing = config_differences(served, config)
    if differing:
        raise ValueError(
            f"{model_dir / 'config.json'} describes another model than the one served: "
            + "; ".join(differing)
        )
    params = dict(model.named_parameters())
    staged: StagedWeights = {}
    with torch.no_grad():
        for name, tensor in checked_tensors(model, checkpoint_files(model_dir)):
            param = params[name]
            staged[name] = tensor.to(device=param.device, dtype=param.dtype, copy=True)
    return staged


def config_differences(served: ModelConfig, new: ModelConfig) -> list[str]:
    """``key: new (served: old)`` for each compared field that differs; the weights'
    storage dtype is not compared (they are converted to the served one)."""
    return [
        f"{f.name}: {getattr(new, f.name)!r} (served: {getattr(served, f.name)!r})"
        for f in dataclasses.fields(ModelConfig)
        if f.compare and getattr(new, f.name) != getattr(served, f.name)
    ]


def swap_in(model: LlamaForCausalLM, staged: StagedWeights) -> None:
    """Copies the staged weights into the served parameters in place, so every tensor the
    forward holds (a tied head, the batch-invariant kernels' operands) sees them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(staged[name])
