"""Dtypes tidearray moves: bf16 (via ml_dtypes), fp16 and fp32."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)

#: Parameter dtypes all-gather moves, and gradient dtypes reduce-scatter reads.
SUPPORTED = {"bfloat16": bfloat16, "float16": float16, "float32": float32}


def normalize(dtype: Any) -> np.dtype:
    """Any dtype spelling (numpy, cupy, 'bfloat16') as a numpy dtype."""
    if isinstance(dtype, str) and dtype in SUPPORTED:
        return SUPPORTED[dtype]
    return np.dtype(dtype)


def name(dtype: Any) -> str:
    return normalize(dtype).name


def is_supported(dtype: Any) -> bool:
    try:
        return normalize(dtype).name in SUPPORTED
    except TypeError:
        return False
