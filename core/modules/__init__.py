"""Building blocks every model shares: attention, rotary embeddings, norms, MLP, parallel layers."""
