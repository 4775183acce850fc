"""Quantized models that stay quantized: in place, saved, loaded, and moved to and from GGUF.

  quantize.py  `quantize_(model, format, plan, filter_fn)`: nn.Linear -> QuantizedLinear, in place.
  linear.py    `QuantizedLinear` (packed buffers; forward is the graphopt::* op the passes emit),
               `FORMATS` (nvfp4, mxfp4, q4_0).
  io.py        `save_quantized` / `load_quantized`: one safetensors file, nothing quantized on load.
  gguf.py      Q4_0 tensors from and to GGUF files (the `gguf` package), byte for byte.
  hf.py        `hf_quantization_config(format)`: transformers' from_pretrained quantizes through quantize_.
"""

from graphopt.quant.hf import hf_quantization_config
from graphopt.quant.io import load_quantized, read_metadata, save_quantized
from graphopt.quant.linear import FORMATS, QuantizedLinear
from graphopt.quant.quantize import default_filter, quantize_, quantized_layers

__all__ = ["FORMATS", "QuantizedLinear", "quantize_", "quantized_layers", "default_filter", "save_quantized",
           "load_quantized", "read_metadata", "hf_quantization_config", "save_gguf", "load_gguf", "read_q4_0"]


def __getattr__(name: str):
    # The GGUF functions load the `gguf` package on first use only.
    if name in ("save_gguf", "load_gguf", "read_q4_0"):
        from graphopt.quant import gguf as _gguf_io

        return getattr(_gguf_io, name)
    raise AttributeError(f"module 'graphopt.quant' has no attribute {name!r}")
