"""Optimizers with quantized state. Reference "equations": they run the full-precision alias's equations on the
dequantized state, so they cannot match torch.optim to float precision after step 1; tests/test_quantize_state.py
checks them against those equations exactly (update = inner update of the dequantized state, new state = the
quantized inner state) and tests/test_quantized_aliases.py against the full-precision aliases. ``min_size=0``
quantizes every leaf, so the battery's small problems exercise the codecs. On DTensor params the 4-bit rows keep one
code per byte (fadam.quantization._sharded)."""

import fadam
from tests.conformance.table import Row

ROWS = [
    Row("adam8bit", fadam.adam8bit, {"lr": 1e-2, "min_size": 0}, reference="equations"),
    Row(
        "adamw8bit",
        fadam.adamw8bit,
        {"lr": 1e-2, "weight_decay": 0.1, "min_size": 0},
        reference="equations",
    ),
    Row("adam4bit", fadam.adam4bit, {"lr": 1e-2, "min_size": 0}, reference="equations"),
    Row("adamw4bit", fadam.adamw4bit, {"lr": 1e-2, "amsgrad": True, "min_size": 0}, reference="equations"),
    Row("sgd8bit", fadam.sgd8bit, {"lr": 1e-2, "momentum": 0.9, "min_size": 0}, reference="equations"),
    Row(
        "lion8bit",
        fadam.lion8bit,
        {"lr": 1e-2, "weight_decay": 0.01, "min_size": 0},
        reference="equations",
    ),
    Row(
        "ademamix8bit",
        fadam.ademamix8bit,
        {"lr": 1e-2, "betas": (0.9, 0.999, 0.99), "alpha": 2.0, "weight_decay": 0.01, "min_size": 0},
        reference="equations",
    ),
]
