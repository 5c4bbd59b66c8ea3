"""Low-precision numerics: formats, quantizers, stochastic rounding, RHT, packing, quantized dots."""
from lowrl.quant.config import FORMATS, QDotConfig, QuantConfig
from lowrl.quant.formats import E2M1, E4M3, E5M2, ElementFormat, element_format
from lowrl.quant.hadamard import inverse_rht, rht
from lowrl.quant.packing import (PackedWeight, bytes_per_param, pack_e2m1, pack_qtensor,
                                 unpack_e2m1)
from lowrl.quant.qdot import make_dot_general, quantized_dot_general
from lowrl.quant.quantize import QTensor, dequantize, fake_quant, quantize
from lowrl.quant.rounding import round_to_grid, sr_cast_bf16, stochastic_round_to_grid

__all__ = [
    "FORMATS", "QDotConfig", "QuantConfig", "E2M1", "E4M3", "E5M2", "ElementFormat",
    "element_format", "rht", "inverse_rht", "bytes_per_param", "pack_e2m1", "unpack_e2m1",
    "PackedWeight", "pack_qtensor",
    "make_dot_general", "quantized_dot_general", "QTensor", "dequantize", "fake_quant", "quantize",
    "round_to_grid", "sr_cast_bf16", "stochastic_round_to_grid",
]
