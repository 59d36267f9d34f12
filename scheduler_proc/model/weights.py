"""Reading a Hugging Face checkpoint directory's weights: which safetensors files hold the
model, its dtype, and copying every tensor into the decoder's parameters by name (HF's
names), exactly once, failing on anything missing, unknown or misshapen."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pipeline.model_config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model directory {model_dir} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The shards model.safetensors.index.json lists, else model.safetensors, else every
    *.safetensors. The index comes first because repositories may carry other weight
    files beside the HF ones (Mistral's consolidated.safetensors, in its own names)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} has no valid 'weight_map': {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index} lists shard(s) {', '.join(missing)} that are not in {model_dir}"
            )
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {model_dir}")
    return files


def checkpoint_dtype(config: ModelConfig, files: list[Path]) -> torch.dtype:
    """config.json's torch_dtype, else the first floating tensor's dtype."""
    if config.dtype is not None:
        return DTYPES[config.dtype]
    with safe_open(str(files[0]), framework="pt", device="cpu") as f:
        for name in f.keys():
            dtype = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
            if dtype is not None:
                return dtype
    return torch.float32


def load_weights(model: nn.Module, files: list[Path]) -> None:
    """Copy every expected tensor exactly once (converted to the model's dtype); fail on
    anything missing, unknown or misshapen."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in checked_tensors(model, files):
            params[name].copy_(tensor)


def checked_tensors(model: nn.Module, files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter's tensor of the checkpoint ``files``, read one at a time, as stored;
    raises ValueError naming the tensor that is unknown, repeated or misshapen, or those
    missing once all are read."""
    config: ModelConfig = model.config  # type: ignore[assignment]
    tied = config.tie_word_embeddings
    expected = dict(model.named_parameters())  # a tied lm_head is not listed separately
    loaded: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                # Old HF exports persist the rotary table; tied checkpoints may still
                # carry a head copy.
                if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                    continue
                param = expected.get(name)
                if param is None:
                    raise ValueError(
                        f"unexpected tensor {name!r} in {path}:"
                        f" not a parameter of {config.architecture}"
                    )
                if name in loaded:
                    raise ValueError(f"tensor {name!r} appears in both {loaded[name]} and {path}")
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(
                        f"tensor {name!r} in {path} has shape {tuple(tensor.shape)},"
                        f" expected {tuple(param.shape)} from config.json"
                    )
                loaded[name] = path
                yield name, tensor
    missing = [name for name in expected if name not in loaded]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint in {files[0].parent} is missing tensor(s) {shown}{more}")
