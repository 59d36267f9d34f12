"""Shape of the decoder, read from and written to a HF ``config.json`` dict, and the context
limit that follows from it. Torch-free, so the API process validates prompts against the same
numbers the scheduler uses.

One decoder serves every supported architecture (``ARCHITECTURES``): the families differ
only in a few switches (biases on the projections, RMSNorm on each head's q and k, the
rotary scaling, a sliding window), which ``from_hf_dict`` reads into this one config. A key
that config.json sets and the decoder does not implement is refused, never ignored: a model
served with a setting silently dropped computes something else than the checkpoint was
trained to compute."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import ServerConfig
from pipeline.hf_config_values import flag, positive_float, positive_int
from pipeline.rope_scaling import RopeScaling, rope_from_hf_dict


@dataclass(frozen=True)
class Architecture:
    """What one ``architectures`` entry means to the decoder."""

    model_type: str
    qkv_bias: bool | None  # None: config.json's ``attention_bias`` decides (q, k, v and o alike)
    qk_norm: bool  # RMSNorm over head_dim on every head's q and k, before the rotary (Qwen3)


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", qkv_bias=None, qk_norm=False),
    # Qwen2 always has q/k/v biases and never an o_proj one.
    "Qwen2ForCausalLM": Architecture("qwen2", qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": Architecture("qwen3", qkv_bias=None, qk_norm=True),
    "MistralForCausalLM": Architecture("mistral", qkv_bias=False, qk_norm=False),
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    qkv_bias: bool = False  # biases on q_proj, k_proj and v_proj
    o_bias: bool = False  # a bias on o_proj (Llama's and Qwen3's attention_bias)
    mlp_bias: bool = False  # biases on gate_proj, up_proj and down_proj
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    # Keys are attended to only within this many positions: the served context is capped to
    # it, where a window and full attention are the same computation.
    sliding_window: int | None = None
    # The checkpoint's torch_dtype ("float32", "bfloat16", "float16"): how its weights are
    # stored, not what the decoder is, so two configs differing only here are equal.
    dtype: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(
                self, "head_dim", self.hidden_size // max(1, self.num_attention_heads)
            )
        for key in _INT_FIELDS:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{key} must be a positive integer, got {value!r}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(unsupported_architecture_message(self.architecture))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture].model_type

    @property
    def context_limit(self) -> int:
        """The longest sequence this decoder computes as the checkpoint does: its positions,
        or its sliding window when that is shorter."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a HF config.json dict of a supported architecture; refuse every setting this
        decoder does not implement rather than compute something else than the checkpoint."""
        architecture = _architecture(d)
        arch = ARCHITECTURES[architecture]
        unknown = sorted(k for k in d if k not in _READ_KEYS and k not in _NEUTRAL_KEYS)
        if unknown:
            raise ValueError(
                f"config keys {', '.join(repr(k) for k in unknown)} are not implemented by "
                f"tokenpipe's {architecture}: refusing to serve the checkpoint without them"
            )
        for key, neutral in _NEUTRAL_KEYS.items():
            if key in d and not neutral(d[key]):
                raise ValueError(
                    f"config key {key!r}={d[key]!r} is not supported by tokenpipe's {architecture}"
                )

        ints = {key: positive_int(d, key) for key in _INT_FIELDS if key != "num_key_value_heads"}
        # HF treats a missing num_key_value_heads as plain multi-head attention.
        if d.get("num_key_value_heads") is None:
            ints["num_key_value_heads"] = ints["num_attention_heads"]
        else:
            ints["num_key_value_heads"] = positive_int(d, "num_key_value_heads")
        head_dim = (
            ints["hidden_size"] // ints["num_attention_heads"]
            if d.get("head_dim") is None
            else positive_int(d, "head_dim")
        )

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config key 'hidden_act'={act!r} is not supported: expected 'silu'")
        attention_bias = flag(d, "attention_bias")
        if arch.qkv_bias is None:
            qkv_bias = o_bias = attention_bias
        else:
            if "attention_bias" in d and attention_bias != arch.qkv_bias:
                raise ValueError(
                    f"config key 'attention_bias'={attention_bias!r} "
                    f"is not supported by {architecture}"
                )
            qkv_bias, o_bias = arch.qkv_bias, False

        rope_theta, rope_scaling = rope_from_hf_dict(d)
        return cls(
            **ints,
            rms_norm_eps=positive_float(d, "rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            tie_word_embeddings=flag(d, "tie_word_embeddings"),
            architecture=architecture,
            head_dim=head_dim,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=flag(d, "mlp_bias"),
            qk_norm=arch.qk_norm,
            rope_scaling=rope_scaling,
            sliding_window=_sliding_window(d, ints["num_hidden_layers"]),
            dtype=_dtype(d),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json transformers reads as the same model (the built-in model's, and
        what ``save_pretrained`` writes)."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_act": "silu",
            **{key: getattr(self, key) for key in _INT_FIELDS},
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mlp_bias": self.mlp_bias,
        }
        if ARCHITECTURES[self.architecture].qkv_bias is None:
            out["attention_bias"] = self.qkv_bias
        if self.rope_scaling is not None:
            out["rope_scaling"] = {
                k: v for k, v in asdict(self.rope_scaling).items() if v is not None
            }
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            if self.model_type != "mistral":
                out["use_sliding_window"] = True
        if self.dtype is not None:
            out["torch_dtype"] = self.dtype
        return out


def unsupported_architecture_message(name: object) -> str:
    return f"architecture {name!r} is not supported; tokenpipe serves {', '.join(ARCHITECTURES)}"


_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)

# Keys from_hf_dict reads (and checks) itself.
_READ_KEYS = frozenset(
    {
        *_INT_FIELDS,
        "architectures",
        "model_type",
        "head_dim",
        "hidden_act",
        "attention_bias",
        "mlp_bias",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "tie_word_embeddings",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "torch_dtype",
        "dtype",
    }
)


def _always(_: Any) -> bool:
    return True


def _falsy(value: Any) -> bool:
    return not value


# Keys that do not change what an inference forward computes (training, generation and
# bookkeeping settings), or that do only at a value other than the one accepted here.
_NEUTRAL_KEYS: dict[str, Any] = {
    **dict.fromkeys(
        (
            "_name_or_path",
            "transformers_version",
            "initializer_range",
            "use_cache",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "sep_token_id",
            "decoder_start_token_id",
            "id2label",
            "label2id",
            "return_dict",
            "output_attentions",
            "output_hidden_states",
            "chunk_size_feed_forward",
            "problem_type",
            "tokenizer_class",
            "prefix",
            "task_specific_params",
            "finetuning_task",
            "attention_dropout",
            "torchscript",
            "tf_legacy_loss",
            "use_bfloat16",
            "architectures_map",
            "is_llama_config",
            "keys_to_ignore_at_inference",
            "max_length",
            "min_length",
            "do_sample",
            "num_beams",
            "temperature",
            "top_k",
            "top_p",
            "repetition_penalty",
            "typical_p",
            "transformers.js_config",  # SmolLM2's: settings of the JavaScript runtime
        ),
        _always,
    ),
    "pretraining_tp": lambda v: v in (None, 1),  # >1 split matmuls in old transformers: refuse
    "is_encoder_decoder": _falsy,
    "add_cross_attention": _falsy,
    "tie_encoder_decoder": _falsy,
    "is_decoder": _always,
    "rope_interleaved": _falsy,  # SmolLM2's: the rotate-half layout is the only one here
    "partial_rotary_factor": lambda v: v in (None, 1, 1.0),
    "quantization_config": lambda v: v is None,
    "pruned_heads": _falsy,
    "mlp_only_layers": _falsy,
}


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures")
    if archs is None:
        # transformers' own configs written without a model class name: by model_type.
        by_type = {a.model_type: name for name, a in ARCHITECTURES.items()}
        if d.get("model_type") in by_type:
            return by_type[d["model_type"]]
        raise ValueError(
            f"config.json names no 'architectures'; {unsupported_architecture_message(None)}"
        )
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise ValueError(f"config key 'architectures' must be a list of one name, got {archs!r}")
    if archs[0] not in ARCHITECTURES:
        raise ValueError(unsupported_architecture_message(archs[0]))
    model_type = d.get("model_type")
    expected = ARCHITECTURES[archs[0]].model_type
    if model_type is not None and model_type != expected:
        raise ValueError(
            f"config key 'model_type'={model_type!r} does not match {archs[0]} "
            f"(expected {expected!r})"
        )
    return archs[0]


def _sliding_window(d: dict[str, Any], num_layers: int) -> int | None:
    """The window, when any layer uses one: Mistral's ``sliding_window``; Qwen's only with
    ``use_sliding_window`` (and on the layers from ``max_window_layers`` on, or as
    ``layer_types`` says: capping the context at the window is exact for all of them)."""
    window = d.get("sliding_window")
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(
            f"config key 'sliding_window' must be a positive integer or null, got {window!r}"
        )
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if (
            not isinstance(layer_types, list)
            or len(layer_types) != num_layers
            or not set(layer_types) <= {"full_attention", "sliding_attention"}
        ):
            raise ValueError(f"config key 'layer_types' is not supported: {layer_types!r}")
        if "sliding_attention" not in layer_types:
            return None
        return window
    if "use_sliding_window" in d and not d["use_sliding_window"]:
        return None
    max_window_layers = d.get("max_window_layers")
    if (
        "use_sliding_window" in d
        and isinstance(max_window_layers, int)
        and max_window_layers >= num_layers
    ):
        return None
    return window


def _dtype(d: dict[str, Any]) -> str | None:
    value = d.get("torch_dtype", d.get("dtype"))
    if value is None:
        return None
    if value not in ("float32", "bfloat16", "float16"):
        raise ValueError(
            f"config key 'torch_dtype'={value!r} is not supported: "
            "expected float32, bfloat16 or float16"
        )
    return str(value)


def default_model_config(vocab_size: int) -> ModelConfig:
    """Small enough that the CPU test suite runs a real model in seconds, with GQA so
    the grouped-head path is exercised."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )


def load_model_config(config: ServerConfig, vocab_size: int) -> ModelConfig:
    """The model directory's ``config.json``, or the built-in model's shape without one."""
    if config.model_path is None:
        return default_model_config(vocab_size)
    path = Path(config.model_path) / "config.json"
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise ValueError(f"model directory has no config.json: {path}") from exc
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    try:
        return ModelConfig.from_hf_dict(raw)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def context_length_of(config: ServerConfig, vocab_size: int) -> int:
    """The longest sequence (prompt plus output) a request may reach. A ``--context-length``
    past a sliding window is refused: beyond it the window and full attention differ."""
    model = load_model_config(config, vocab_size)
    limit = model.context_limit
    if (
        config.context_length is not None
        and model.sliding_window is not None
        and config.context_length > limit
    ):
        raise ValueError(
            f"--context-length {config.context_length} exceeds the model's sliding_window "
            f"({model.sliding_window}): tokenpipe attends over the whole context, which equals "
            f"the window's attention only within {limit} tokens; "
            f"pass --context-length {limit} or less"
        )
    return min(config.context_length or limit, limit)
