"""Checks of the transforms' request parameters: each returns the value to use or raises ValueError
with the expectation in words (validation prefixes where the parameter was found)."""

from __future__ import annotations

import math
from collections.abc import Callable

from teacher_server.errors import echo
from teacher_server.spec import FLOAT_OUTPUT_DTYPES

Check = Callable[[object], object]


def boolean(name: str) -> Check:
    def check(value: object) -> object:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a boolean (bool_param), got {echo(value)}")
        return value
    return check


def top_k(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"top_k must be a non-negative integer (int64_param), got {echo(value)}")
    return value


def temperature(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"temperature must be a finite number > 0 (double_param), got {echo(value)}")
    return float(value)


def output_dtype(value: object) -> object:
    if not isinstance(value, str) or value.upper() not in FLOAT_OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {', '.join(FLOAT_OUTPUT_DTYPES)}, got {echo(value)}")
    return value.upper()
