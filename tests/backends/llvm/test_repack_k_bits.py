"""The repacked K-quant layout (repack_k.py) stores each value in as many bits as ggml's block does;
what it adds to ggml's bytes is only its scales and mins widened to a byte each."""

from __future__ import annotations

import pytest

from llamir.backends.llvm.kernels.repack_k import K_FORMATS
from llamir.ir import dtype_named

BITS = {"q2_k": 2, "q3_k": 3, "q4_k": 4, "q5_k": 5, "q6_k": 6}              # per value (qs, qh, hmask)
GGML_SCALES = {"q2_k": 16, "q3_k": 12, "q4_k": 12, "q5_k": 12, "q6_k": 16}   # bytes per block
OUR_SCALES = {"q2_k": 32, "q3_k": 16, "q4_k": 16, "q5_k": 16, "q6_k": 16}    # sc (+ mn) per row


@pytest.mark.parametrize("name", list(K_FORMATS))
def test_values_take_ggml_bits(name):
    fmt = K_FORMATS[name]
    assert fmt.q_bytes == 16 * 256 * BITS[name] // 8
    ggml_block = dtype_named(name).type_size                    # 16 rows of one super-block
    assert 16 * ggml_block == fmt.q_bytes + 16 * (GGML_SCALES[name] + (4 if fmt.has_min else 2))
    assert fmt.block_bytes - 16 * ggml_block == 16 * (OUR_SCALES[name] - GGML_SCALES[name])
