"""References for sampling tests: exact top-k marginals from HF transformers, and the
chi-square test of drawn tokens against them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def chi_square_p_value(counts: torch.Tensor, expected_probabilities: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of ``counts`` against the probabilities, over the
    tokens they keep (bins expecting fewer than 5 draws merged into one); 0 when a token they
    filter out was drawn."""
    kept = expected_probabilities > 0
    if counts[~kept].any():
        return 0.0
    expected = expected_probabilities[kept].double() * counts.sum()
    observed = counts[kept].double()
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees = torch.tensor(len(expected) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(degrees / 2, statistic / 2))


def exact_top_k_marginals(
    checkpoint: str | Path,
    prompt: torch.Tensor,
    steps: int,
    top_k: int,
    processors: Any = None,
) -> list[torch.Tensor]:
    """P(t_1), ..., P(t_steps) [vocab] of top-k sampling at temperature 1 after ``prompt``
    ([length]), computed with HF transformers over every path of ``steps`` tokens (top_k**steps
    of them): the reference that sampled speculation is tested against. ``processors`` (a
    transformers LogitsProcessorList) run before the top-k filter, as in HF's ``generate()``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    paths: dict[tuple[int, ...], float] = {(): 1.0}
    marginals = []
    with torch.no_grad():
        for _ in range(steps):
            prefixes = list(paths)
            inputs = torch.stack(
                [torch.cat([prompt, torch.tensor(p, dtype=torch.long)]) for p in prefixes]
            )
            logits = hf(inputs).logits[:, -1]
            if processors is not None:
                logits = processors(inputs, logits)
            kth = logits.topk(top_k, dim=-1).values[..., -1:]
            probabilities = logits.masked_fill(logits < kth, float("-inf")).softmax(-1)
            marginal = torch.zeros(probabilities.shape[-1], dtype=torch.float64)
            longer = {}
            for prefix, row in zip(prefixes, probabilities, strict=True):
                for token in row.nonzero().flatten().tolist():
                    weight = paths[prefix] * float(row[token])
                    marginal[token] += weight
                    longer[(*prefix, token)] = weight
            marginals.append(marginal)
            paths = longer
    return marginals
