"""Each token loss (docs/algorithms.md §5) against an independent float64 computation on hand-made cases: values
written element by element in plain Python (no masks, no broadcasting), gradients by finite differences."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.algorithms.token_losses import (
    aggregate,
    dpo_loss,
    gspo_loss,
    k3_kl,
    overlong_penalty,
    token_ppo_loss,
)

# two responses: 3 tokens and 2 tokens (the third position is padding)
LP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]]
OLD = [[-1.1, -0.9, -1.9], [-0.1, -1.3, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.5, -0.7]


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def ppo_reference(lp, old, adv, mask, lo, hi, agg):
    """max(−A·ρ, −A·clip(ρ)) per real token, then per-sequence means (GRPO) or one mean over all tokens (DAPO)."""
    per_seq, all_tokens = [], []
    for b in range(len(lp)):
        terms = []
        for j in range(len(lp[b])):
            if not mask[b][j]:
                continue
            ratio = math.exp(lp[b][j] - old[b][j])
            clipped = min(max(ratio, 1 - lo), 1 + hi)
            terms.append(max(-adv[b] * ratio, -adv[b] * clipped))
        per_seq.append(sum(terms) / len(terms))
        all_tokens += terms
    return sum(per_seq) / len(per_seq) if agg == "seq_mean_token_mean" else sum(all_tokens) / len(all_tokens)


def finite_difference(fn, x: list[list[float]], eps: float = 1e-6) -> list[list[float]]:
    grads = []
    for b in range(len(x)):
        row = []
        for j in range(len(x[b])):
            up = [r[:] for r in x]
            down = [r[:] for r in x]
            up[b][j] += eps
            down[b][j] -= eps
            row.append((fn(up) - fn(down)) / (2 * eps))
        grads.append(row)
    return grads


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "token_mean"])
def test_grpo_token_clip_matches_reference(agg):
    lp = t(LP).requires_grad_(True)
    loss, ratio, clipped, _ = token_ppo_loss(lp, t(OLD), t(ADV), t(MASK), 0.2, 0.2, agg=agg)
    assert loss.item() == pytest.approx(ppo_reference(LP, OLD, ADV, MASK, 0.2, 0.2, agg), abs=1e-12)
    # token (0, 1): ρ = e^0.4 = 1.49 > 1.2 with A > 0 -> clipped, no gradient; (1, 0): ρ = e^-0.2 = 0.82 with A < 0
    # is inside [0.8, 1.2] -> not clipped
    assert clipped[0, 1] and not clipped[1, 0]
    loss.backward()
    expected = finite_difference(lambda x: ppo_reference(x, OLD, ADV, MASK, 0.2, 0.2, agg), LP)
    assert torch.allclose(lp.grad, t(expected), atol=1e-7)
    assert lp.grad[0, 1] == 0 and lp.grad[1, 2] == 0  # clipped token, padding


def test_dapo_asymmetric_clip_and_token_normalisation():
    # ρ = e^0.22 = 1.246: above 1 + 0.2 (clipped by GRPO's symmetric range), below 1 + 0.28 (DAPO's clip-higher)
    lp, old, adv, mask = [[0.22, -1.0, -1.0], [-0.5, 0.0, 0.0]], [[0.0, -1.0, -1.0], [-0.5, 0.0, 0.0]], [1.0, -1.0], \
        [[1, 1, 1], [1, 0, 0]]
    x = t(lp).requires_grad_(True)
    dapo, _, clipped, _ = token_ppo_loss(x, t(old), t(adv), t(mask), 0.2, 0.28, agg="token_mean")
    assert not clipped[0, 0]
    assert dapo.item() == pytest.approx(ppo_reference(lp, old, adv, mask, 0.2, 0.28, "token_mean"), abs=1e-12)
    # token mean: (−1.246 − 1 − 1 + 1) / 4; the sequence mean would weigh the 1-token response 3× more
    assert dapo.item() == pytest.approx((-math.exp(0.22) - 1 - 1 + 1) / 4, abs=1e-12)
    seq = ppo_reference(lp, old, adv, mask, 0.2, 0.28, "seq_mean_token_mean")
    assert abs(dapo.item() - seq) > 0.1
    dapo.backward()
    assert x.grad[0, 0].item() == pytest.approx(-math.exp(0.22) / 4, abs=1e-12)
    grpo, _, clipped, _ = token_ppo_loss(t(lp), t(old), t(adv), t(mask), 0.2, 0.2, agg="token_mean")
    assert clipped[0, 0] and grpo.item() == pytest.approx((-1.2 - 1 - 1 + 1) / 4, abs=1e-12)


def test_rejected_tokens_count_in_the_denominator():
    w = t([[1.0, 0.0, 1.0], [0.5, 1.0, 1.0]])
    loss = aggregate(t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), t(MASK), w, "seq_mean_token_mean")
    assert loss.item() == pytest.approx(((1 + 3) / 3 + (2 + 5) / 2) / 2, abs=1e-12)


def gspo_reference(lp, old, adv, mask, lo, hi):
    """s = exp(mean over real tokens of (log π − log π_old)); ℓ = max(−A·s, −A·clip(s)); mean over sequences."""
    out = []
    for b in range(len(lp)):
        real = [j for j in range(len(lp[b])) if mask[b][j]]
        s = math.exp(sum(lp[b][j] - old[b][j] for j in real) / len(real))
        out.append(max(-adv[b] * s, -adv[b] * min(max(s, 1 - lo), 1 + hi)))
    return sum(out) / len(out)


def test_gspo_sequence_ratio_and_gradient_through_every_token():
    lo, hi = 0.3, 0.4  # wide enough that neither sequence is clipped: every real token must get a gradient
    lp = t(LP).requires_grad_(True)
    loss, seq_ratio, clipped, _ = gspo_loss(lp, t(OLD), t(ADV), t(MASK), lo, hi)
    s0 = math.exp(((-1.0 + 1.1) + (-0.5 + 0.9) + (-2.0 + 1.9)) / 3)
    s1 = math.exp(((-0.3 + 0.1) + (-1.2 + 1.3)) / 2)
    assert seq_ratio.tolist() == pytest.approx([s0, s1], abs=1e-12)
    assert not clipped.any()
    assert loss.item() == pytest.approx(gspo_reference(LP, OLD, ADV, MASK, lo, hi), abs=1e-12)
    loss.backward()
    expected = finite_difference(lambda x: gspo_reference(x, OLD, ADV, MASK, lo, hi), LP)
    assert torch.allclose(lp.grad, t(expected), atol=1e-7)
    real = t(MASK).bool()
    assert (lp.grad[real] != 0).all() and (lp.grad[~real] == 0).all()
    # ∂L/∂log π_t = −A·s / (2 sequences · n_tokens): the same for every token of a sequence
    assert lp.grad[0].tolist() == pytest.approx([-ADV[0] * s0 / 6] * 3, abs=1e-12)


def test_gspo_clips_the_whole_sequence():
    lp = t(LP).requires_grad_(True)
    loss, seq_ratio, clipped, _ = gspo_loss(lp, t(OLD), t(ADV), t(MASK), 3e-4, 4e-4)
    # s0 = e^(0.4/3) = 1.14 with A > 0 is above 1 + 4e-4: the whole first sequence is clipped (no gradient at all)
    assert clipped.tolist() == [True, True]
    assert loss.item() == pytest.approx(gspo_reference(LP, OLD, ADV, MASK, 3e-4, 4e-4), abs=1e-12)
    loss.backward()
    assert (lp.grad == 0).all()


def test_dpo_and_ipo_match_reference():
    chosen, rejected, ref_c, ref_r = t([-3.0, -10.0]), t([-5.0, -4.0]), t([-4.0, -9.0]), t([-4.5, -5.0])
    beta = 0.1
    h = [(-3 + 5) - (-4 + 4.5), (-10 + 4) - (-9 + 5)]  # 1.5, -2.0
    dpo, margin = dpo_loss(chosen, rejected, ref_c, ref_r, beta, "sigmoid")
    assert dpo.tolist() == pytest.approx([math.log(1 + math.exp(-beta * x)) for x in h], abs=1e-12)
    assert margin.tolist() == pytest.approx([beta * x for x in h], abs=1e-12)
    ipo, _ = dpo_loss(chosen, rejected, ref_c, ref_r, beta, "ipo")
    assert ipo.tolist() == pytest.approx([(x - 1 / (2 * beta)) ** 2 for x in h], abs=1e-12)
    c = chosen.clone().requires_grad_(True)
    dpo_loss(c, rejected, ref_c, ref_r, beta, "sigmoid")[0].sum().backward()
    assert c.grad.tolist() == pytest.approx([-beta / (1 + math.exp(beta * x)) for x in h], abs=1e-12)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(chosen, rejected, ref_c, ref_r, beta, "hinge")


def test_k3_kl_and_overlong_penalty():
    lp, ref = t([-1.0, -2.0, -0.5]), t([-1.0, -1.0, -2.0])
    assert k3_kl(lp, ref).tolist() == pytest.approx([math.exp(r - p) - (r - p) - 1 for p, r in
                                                      zip([-1.0, -2.0, -0.5], [-1.0, -1.0, -2.0], strict=True)])
    assert k3_kl(lp, ref)[0] == 0 and (k3_kl(lp, ref) >= 0).all()
    lengths = torch.tensor([10, 12, 14, 16, 20])
    # max 16, buffer 4: no penalty up to 12, then linear to −1 at 16 (and −1 beyond)
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == pytest.approx([0, 0, -0.5, -1, -1])
    assert overlong_penalty(lengths, 16, 0).tolist() == [0.0] * 5
