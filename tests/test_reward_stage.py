"""The reward stage refuses bad scores instead of training on them."""

import pytest
import torch

from polyrl.batch import Rollout
from polyrl.rewards import RewardOutput
from polyrl.rewards.stage import score_batch


def _batch(b=3):
    return Rollout(
        prompts=["a red circle"] * b, metadata=[{}] * b, group_ids=torch.zeros(b, dtype=torch.long),
        cond={"pooled": torch.zeros(b, 2)}, shared={}, latents={"x": torch.zeros(b, 2, 1, 2, 2)},
        log_probs=torch.zeros(b, 1), sigmas=torch.zeros(b, 2), noise_levels=torch.zeros(b, 1),
        final={"x": torch.zeros(b, 1, 2, 2)}, media={"images": torch.zeros(b, 3, 4, 4)},
    )


def test_scores_are_attached():
    batch = _batch()
    score_batch(lambda i, p, m: RewardOutput(torch.tensor([0.1, 0.2, 0.3]), {"x": [1, 2, 3]}), "fake", batch)
    assert torch.allclose(batch.rewards, torch.tensor([0.1, 0.2, 0.3])) and batch.reward_extras == {"x": [1, 2, 3]}


@pytest.mark.parametrize("scores", [[0.1, float("nan"), 0.3], [0.1, 0.2]])
def test_bad_scores_stop_the_step(scores):
    with pytest.raises(RuntimeError, match=r"reward 'fake' returned .* refusing to train"):
        score_batch(lambda i, p, m: RewardOutput(torch.tensor(scores)), "fake", _batch())


def test_select_and_cat_round_trip():
    batch = _batch(4)
    batch.rewards = torch.arange(4.0)
    parts = [batch.select(torch.tensor([2, 3])), batch.select(torch.tensor([0, 1]))]
    joined = Rollout.cat(parts)
    assert joined.rewards.tolist() == [2.0, 3.0, 0.0, 1.0] and len(joined) == 4
    # nested per-sample dicts (latents, an algorithm's extras) follow the samples; `shared` is kept whole
    batch.extras = {"pair_final": {"x": torch.arange(4.0).view(4, 1, 1, 1)}}
    batch.shared = {"neg": torch.ones(1, 2)}
    sub = batch.select(torch.tensor([3, 1]))
    assert sub.extras["pair_final"]["x"].flatten().tolist() == [3.0, 1.0] and sub.shared["neg"].shape == (1, 2)
    assert Rollout.cat([sub, sub]).extras["pair_final"]["x"].flatten().tolist() == [3.0, 1.0, 3.0, 1.0]
