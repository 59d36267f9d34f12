"""The model's settings: which checkpoint, where and in what dtype it runs, its mode and the
longest request. The first section of ``ServerConfig`` (``pipeline/config.py``), which extends
this struct: declared apart to keep that file readable, listed first by ``--help`` as before,
and still one config object every process receives."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pipeline.flags import Flag

Mode = Literal["generate", "embedding", "dllm"]
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]


class ModelSettings(msgspec.Struct, kw_only=True):
    """The ``model`` group of flags; each field declared once, with its flag beside it."""

    model_path: Annotated[str | None, Flag("model", "local Hugging Face-style model directory")] = (
        None
    )
    served_model_name: Annotated[
        str | None,
        Flag("model", "the model name the API reports (default: the model directory's name)"),
    ] = None
    model_seed: Annotated[int, Flag("model", "seed of the built-in model's weights")] = 0
    weight_version: Annotated[str, Flag("model", "the served weights' version")] = "default"
    device: Annotated[
        str, Flag("model", "auto (CUDA when available, else CPU), cpu, cuda, cuda:N")
    ] = "auto"
    dtype: Annotated[
        ModelDtype,
        Flag(
            "model",
            "weights and KV cache: auto (the checkpoint's torch_dtype; float32 for the built-in "
            "model), float32, bfloat16, float16",
        ),
    ] = "auto"
    # None: as many as the cores the other processes leave idle (thread_budget.py)
    torch_threads: Annotated[
        int | None,
        Flag(
            "model",
            "CPU threads for the model, pinned (default: as many as the cores the other "
            "processes leave idle, measured while serving; see docs/operations.md)",
        ),
    ] = None
    mode: Annotated[
        Mode,
        Flag(
            "model",
            "generate: text generation; embedding: mean-pooled embeddings (/v1/embeddings, "
            "/encode); dllm: block diffusion decoding",
        ),
    ] = "generate"
    context_length: Annotated[
        int | None,
        Flag(
            "model",
            "longest prompt plus output of a request (default, and at most: the model's "
            "max_position_embeddings)",
        ),
    ] = None
    skip_tokenizer_init: Annotated[
        bool,
        Flag(
            "model",
            "token ids in, token ids out (SGLang's flag): no process loads a tokenizer; prompts "
            "are token ids and answers carry output ids without text; text prompts, chat, stop "
            "strings and media get 400",
        ),
    ] = False
