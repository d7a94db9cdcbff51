"""Quantized optimizer state: blockwise 8-bit and 4-bit codecs and the ``quantize_state`` wrapper."""

from fadam.quantization._codec import QuantizedArray, dequantize_blockwise, quantize_blockwise
from fadam.quantization._maps import dynamic_map, linear_nonzero_map
from fadam.quantization._wrapper import QuantizedState, quantize_state

__all__ = [
    "QuantizedArray",
    "QuantizedState",
    "dequantize_blockwise",
    "dynamic_map",
    "linear_nonzero_map",
    "quantize_blockwise",
    "quantize_state",
]
