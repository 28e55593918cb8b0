"""EAGLE speculative decoding with fused speculation (see :mod:`.hooks`)."""
