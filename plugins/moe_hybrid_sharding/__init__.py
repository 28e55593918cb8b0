"""MoE hybrid sharding: context encoding and token generation each with their own expert
layout."""
