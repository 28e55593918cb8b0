"""greedy_tokens is argmax: the first of equal maxima, NaN taken as the largest."""

import torch

from nxdplug.runtime.batch_sampler import greedy_tokens


def test_greedy_tokens_equal_argmax_on_ties_and_nan():
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for width in (1, 7, 32000, 32003):
            logits = (torch.randn(4, 3, width, generator=generator) * 0.01).round(decimals=2)
            logits = logits.to(dtype)
            logits[0, 0, width // 2 :] = logits.max()  # a tie across the row's second half
            logits[1, 1, width - 1] = float("nan")
            expected = logits.argmax(dim=-1)
            assert torch.equal(greedy_tokens(logits), expected)
    assert greedy_tokens(torch.tensor([[2.0, 5.0, 5.0, 1.0]])).tolist() == [1]
