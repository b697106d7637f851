"""Every family builds its weights from an explicit generator: the same seed gives the same
weights whatever the global random state, another seed other weights, and building a model leaves
the global random state as it was (issue: reproducible from scratch)."""

from __future__ import annotations

import pytest
import torch

from ctxmodels.registry import FAMILIES, build_model


def weights(family: str, seed: int, global_seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(global_seed)
    before = torch.random.get_rng_state()
    _, model = build_model(family, "tiny", {"vocab_size": 64}, seed=seed)
    assert torch.equal(torch.random.get_rng_state(), before), f"{family}: building the model changed the global random state"
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_weights_follow_the_seed_and_nothing_else(family):
    a = weights(family, seed=1, global_seed=0)
    b = weights(family, seed=1, global_seed=12345)  # another global state: the same weights
    for name in a:
        assert torch.equal(a[name], b[name]), f"{family}: {name} depends on the global random state"
    c = weights(family, seed=2, global_seed=0)
    drawn = [n for n in a if a[n].is_floating_point() and a[n].numel() > 1 and a[n].std() > 0]
    assert drawn and any(not torch.equal(a[n], c[n]) for n in drawn), f"{family}: the seed changes no weight"
    same_dist = sum(not torch.equal(a[n], c[n]) for n in drawn)
    assert same_dist == len(drawn), f"{family}: {len(drawn) - same_dist} random tensors ignore the seed"
