"""torch.compile's caches saved by one run and loaded by the next (perf/compile.py, `model.compile_cache`): a fresh
process with an empty inductor cache directory that loads the saved artifacts compiles nothing, and the trainer
loads the file before the model is built and saves it after the first step and at each checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from test_cli_train import _common

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from polyrl.perf.compile import compile_transformer, load_compile_cache, save_compile_cache

    class Block(torch.nn.Module):  # a class of its own: dynamo does not trace torch.nn's own module classes
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
        def forward(self, x):
            return torch.nn.functional.gelu(self.linear(x)) + x

    class Net(torch.nn.Module):  # two equal blocks: regional compilation compiles one graph per mode
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    path, role = Path(sys.argv[1]), sys.argv[2]
    loaded = load_compile_cache(path) if role == "load" else 0
    net = Net()
    compile_transformer(net, "blocks")
    x = torch.randn(4, 8, requires_grad=True)
    net(x).sum().backward()
    with torch.no_grad():
        net(x)
    written = save_compile_cache(path) if role == "save" else 0
    c = torch._dynamo.utils.counters["inductor"]
    print(json.dumps({"loaded": loaded, "written": written, "hit": c["fxgraph_cache_hit"],
                      "miss": c["fxgraph_cache_miss"]}))
""")


def _run(tmp_path, role: str, cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache_dir)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "compile_cache.bin"), role], env=env,
                         capture_output=True, text=True, timeout=600, check=True, cwd=Path(__file__).parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_saved_artifacts_make_a_fresh_process_compile_nothing(tmp_path):
    first = _run(tmp_path, "save", "inductor_a")
    assert first["miss"] >= 2 and first["written"] > 0  # forward, backward and no-grad graphs compiled
    again = _run(tmp_path, "load", "inductor_b")  # another empty cache directory: only the artifacts can help
    assert again["loaded"] == first["written"] and again["miss"] == 0
    assert again["hit"] == first["hit"] + first["miss"]  # `first` is the control: an empty cache compiles


def test_trainer_loads_before_building_and_saves_after_the_first_step(tiny_sd3_dir, shape_prompts_file, tmp_path,
                                                                       monkeypatch):
    import polyrl.trainer.build as build
    import polyrl.trainer.loop as loop
    from polyrl.cli.main import main

    calls = []
    monkeypatch.setattr(build, "compile_transformer", lambda network, mode: calls.append(("compile", mode)))
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: None)  # the SD3 adapter's VAE decoder
    monkeypatch.setattr(build, "load_compile_cache", lambda path: calls.append(("load", path)) or 0)
    monkeypatch.setattr(loop, "save_compile_cache", lambda path: calls.append(("save", path)) or 0)
    real_build = build.build_model
    monkeypatch.setattr(build, "build_model", lambda *a, **k: calls.append(("build",)) or real_build(*a, **k))
    out = tmp_path / "run"
    # model.compile=blocks, with compilation itself stubbed out (the wiring is what is tested; the first test the cache)
    args = _common(tiny_sd3_dir, shape_prompts_file, out, 3, ["trainer.eval_every=0", "trainer.save_every=2",
                                                               "model.compile=blocks"])
    assert main(args) == 0
    cache = out / "compile_cache.bin"
    names = [c[0] for c in calls]
    assert names[:2] == ["load", "build"] and calls[0][1] == cache
    assert [c for c in calls if c[0] == "save"] == [("save", cache)] * 3  # after step 1 and the checkpoints 2, 3
    calls.clear()
    assert main([a for a in args if not a.startswith(("trainer.output_dir", "trainer.max_steps"))]
                + [f"trainer.output_dir={tmp_path / 'off'}", "trainer.max_steps=1", "model.compile_cache=null"]) == 0
    cached = [c for c in calls if c[0] in ("load", "save")]
    assert cached and all(path is None for _, path in cached)  # model.compile_cache=null: no file anywhere


def test_unreadable_cache_is_a_warning_and_the_run_goes_on(tiny_sd3_dir, shape_prompts_file, tmp_path, monkeypatch,
                                                           capsys):
    import polyrl.trainer.build as loop
    from polyrl.cli.main import main

    monkeypatch.setattr(loop, "compile_transformer", lambda network, mode: None)  # the load is what is tested
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: None)  # the SD3 adapter's VAE decoder
    bad = tmp_path / "stale.bin"
    bad.write_bytes(b"not a torch cache")
    args = _common(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", 1, ["trainer.eval_every=0",
                                                                          "trainer.save_every=0", "model.compile=blocks",
                                                                          f"model.compile_cache={bad}"])
    assert main(args) == 0
    err = capsys.readouterr().err
    assert f"polyrl: warning: compile cache not loaded: {bad}: torch cannot read these compile-cache artifacts" in err


def test_uncompiled_runs_touch_no_cache(tiny_sd3_dir, shape_prompts_file, tmp_path):
    from polyrl.cli.main import main

    out = tmp_path / "run"
    assert main(_common(tiny_sd3_dir, shape_prompts_file, out, 1, ["trainer.eval_every=0", "trainer.save_every=1"])) == 0
    assert not (out / "compile_cache.bin").exists()
