"""actor.gradient_checkpointing as a share of the blocks: which blocks recompute, and the refusals."""

import pytest
import torch
from diffusers import WanTransformer3DModel

from polyrl.actor.local import checkpointed_blocks, enable_checkpointing
from polyrl.errors import UserError


def test_checkpointed_blocks_are_the_share_evenly_spread():
    assert checkpointed_blocks(30, 1.0) == list(range(30))
    assert checkpointed_blocks(30, 0.5) == list(range(1, 30, 2))
    assert checkpointed_blocks(4, 0.25) == [3]
    assert len(checkpointed_blocks(30, 0.3)) == 9


def tiny_wan(layers: int) -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=layers,
                                 rope_max_seq_len=32)


@pytest.mark.parametrize("setting,recomputed", [(True, 4), (0.5, 2), (0.25, 1)])
def test_only_the_share_of_blocks_is_recomputed_in_the_backward(setting, recomputed):
    net = tiny_wan(4)
    enable_checkpointing("transformer", net, setting)
    calls = [0] * 4
    for i, block in enumerate(net.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    x, text = torch.randn(1, 4, 2, 4, 4), torch.randn(1, 3, 16)
    net(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text, return_dict=False)[0].sum().backward()
    # a checkpointed block runs twice (forward, recompute in the backward), the others once
    assert sum(c == 2 for c in calls) == recomputed and sum(c == 1 for c in calls) == 4 - recomputed


def test_a_share_outside_zero_one_is_refused():
    with pytest.raises(UserError, match=r"actor.gradient_checkpointing=1.5: true, false or a share"):
        enable_checkpointing("transformer", tiny_wan(2), 1.5)


def test_a_share_of_a_network_without_repeated_blocks_is_refused():
    class Flat(torch.nn.Module):  # checkpointable, but nothing to choose a share of
        _supports_gradient_checkpointing = True

        def enable_gradient_checkpointing(self, func=None):
            raise AssertionError("not reached")

    with pytest.raises(UserError, match=r"actor.gradient_checkpointing=0.5: transformer \(Flat\) checkpoints all "
                                        r"of its blocks or none \(true or false\)"):
        enable_checkpointing("transformer", Flat(), 0.5)
