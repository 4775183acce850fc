"""transformers' quantizer hook: `from_pretrained(..., quantization_config=hf_quantization_config("nvfp4"))`.

transformers loads the checkpoint's weights as usual, then hands the model to the quantizer
registered for the config's `quant_method` ("graphopt"), which runs `quantize_` on it: the linear
layers become QuantizedLinear (FP4 or Q4_0 codes and scales) and their dense weights are released.
The dense weights are resident while they load (quantization follows loading), as with torchao's
quantizer; a saved quantized model loads without them through `load_quantized`. HF's own
`save_pretrained` of such a model is refused (`is_serializable`): save it with `save_quantized`.

The config and quantizer classes derive from transformers' and are made, and registered with
transformers, on the first call (transformers is imported only then).
"""

from __future__ import annotations

import functools
from typing import Any

QUANT_METHOD = "graphopt"


@functools.lru_cache(maxsize=None)
def _classes() -> tuple[type, type]:
    """(config class, quantizer class), registered with transformers under QUANT_METHOD."""
    from transformers.quantizers import HfQuantizer
    from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                              register_quantization_config, register_quantizer)
    from transformers.utils.quantization_config import QuantizationConfigMixin

    from graphopt.quant.linear import check_format
    from graphopt.quant.quantize import quantize_

    class GraphOptQuantizationConfig(QuantizationConfigMixin):
        """graphopt weight quantization for from_pretrained: `format` nvfp4, mxfp4 or q4_0;
        linear layers whose qualified name is in, or ends with an entry of,
        `modules_to_not_convert` stay dense."""

        def __init__(self, format: str = "nvfp4", modules_to_not_convert: list[str] | None = None, **kwargs: Any):
            check_format(format)
            self.quant_method = QUANT_METHOD
            self.format = format
            self.modules_to_not_convert = list(modules_to_not_convert or [])

        def to_dict(self) -> dict[str, Any]:
            return {"quant_method": QUANT_METHOD, "format": self.format,
                    "modules_to_not_convert": list(self.modules_to_not_convert)}

    class GraphOptHfQuantizer(HfQuantizer):
        """Quantizes the loaded model in place with graphopt.quantize_."""

        requires_calibration = False

        def _process_model_before_weight_loading(self, model, **kwargs):
            return model

        def _process_model_after_weight_loading(self, model, **kwargs):
            keep = tuple(self.quantization_config.modules_to_not_convert)

            def selected(module, name: str) -> bool:
                return not any(name == k or name.endswith("." + k) for k in keep)

            quantize_(model, format=self.quantization_config.format, filter_fn=selected)
            return model

        def is_serializable(self, *args, **kwargs) -> bool:
            return False  # graphopt.save_quantized writes the packed layers

        @property
        def is_trainable(self) -> bool:
            return False

        @property
        def is_compileable(self) -> bool:
            return True  # QuantizedLinear runs graphopt::* ops, which Inductor and graphopt compile

    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(GraphOptQuantizationConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(GraphOptHfQuantizer)
    return AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD], AUTO_QUANTIZER_MAPPING[QUANT_METHOD]


def hf_quantization_config(format: str = "nvfp4", modules_to_not_convert: list[str] | None = None):
    """A transformers quantization config: pass it to `from_pretrained(..., quantization_config=...)`
    and the loaded model's linear layers are quantized by graphopt.quantize_ to `format`."""
    config_class, _ = _classes()
    return config_class(format=format, modules_to_not_convert=modules_to_not_convert)


__all__ = ["hf_quantization_config", "QUANT_METHOD"]
