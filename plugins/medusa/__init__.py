"""Medusa speculative decoding: trained heads on the target's last hidden state propose a tree
of tokens that the target verifies in one call (see :mod:`nxdplug.plugins.medusa.hooks`)."""
