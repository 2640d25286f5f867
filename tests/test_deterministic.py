"""`trainer.deterministic=true`: two runs of the same config give bit-identical checkpoints (LoRA and EMA weights,
AdamW state), and an op without a deterministic kernel is named in one line when the run reaches it (issue 47
item 4; on the CPU here, the GPU check is scripts/gpu_matrix.py --deterministic)."""

from __future__ import annotations

import torch
from checkpoint_helpers import train_args

from polyrl.cli.main import main
from polyrl.trainer.checkpoint_compare import checkpoint_differences


def test_two_deterministic_runs_give_bit_identical_checkpoints(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        assert main(train_args(tiny_sd3_dir, shape_prompts_file, run, 2, "trainer.save_every=2")) == 0
    a, b = (run / "checkpoints" / "step_000002" for run in runs)
    assert sorted(p.name for p in a.glob("*.safetensors")) == ["adapter_model.safetensors", "old_weights.safetensors"]
    assert checkpoint_differences(a, b) == []
    # the comparison sees one flipped bit in the optimizer's state, and one in a weight
    state = torch.load(b / "trainer_state.pt", weights_only=True)
    moment = state["optimizer"]["state"][0]["exp_avg"]
    moment.view(torch.int32).view(-1)[0] ^= 1
    torch.save(state, b / "trainer_state.pt")
    assert checkpoint_differences(a, b) == ["optimizer.state.0.exp_avg"]


def test_an_op_without_a_deterministic_kernel_is_named_once(tiny_sd3_dir, shape_prompts_file, tmp_path, monkeypatch,
                                                              capsys):
    from torch._prims_common import alert_not_deterministic

    from polyrl.sampling import diffusion

    original = diffusion.sample_latents

    def with_a_nondeterministic_op(*args, **kwargs):  # what a CUDA kernel without a deterministic twin reports
        alert_not_deterministic("scatter_add_cuda_kernel")
        alert_not_deterministic("scatter_add_cuda_kernel")  # named once, however often it runs
        return original(*args, **kwargs)

    monkeypatch.setattr(diffusion, "sample_latents", with_a_nondeterministic_op)
    assert main(train_args(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", 1, "trainer.save_every=0")) == 0
    err = capsys.readouterr().err
    named = [line for line in err.splitlines() if "scatter_add_cuda_kernel" in line]
    assert named == ["polyrl: warning: trainer.deterministic=true, but scatter_add_cuda_kernel has no deterministic "
                     "kernel: this run is not bit-identical to another where it runs"], err
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
