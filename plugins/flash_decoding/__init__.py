"""Flash decoding (``flash_decoding_enabled``): the KV cache split along the sequence over the
ranks that share a K/V head, each rank's partial attention merged exactly."""
