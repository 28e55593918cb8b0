"""Automatic bucket sizes for the context-encoding and token-generation sub-models."""

from __future__ import annotations

DEFAULT_MIN_BUCKET = 128


def generate_buckets(min_length: int, max_length: int) -> list[int]:
    """``min_length``, then doublings of it below ``max_length``, then ``max_length``.

    With the default ``min_length`` of 128 these are the powers of two from 128 up to the
    maximum, plus the maximum: ``generate_buckets(128, 1000) == [128, 256, 512, 1000]``. When
    ``max_length <= min_length`` the only bucket is ``max_length``.
    """
    if min_length < 1 or max_length < 1:
        raise ValueError(
            f"bucket lengths must be positive; got min_length={min_length}, max_length={max_length}"
        )
    buckets = []
    length = min_length
    while length < max_length:
        buckets.append(length)
        length *= 2
    buckets.append(max_length)
    return buckets
