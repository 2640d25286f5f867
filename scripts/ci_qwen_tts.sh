#!/usr/bin/env bash
# CI for model=qwen3_tts (docs/audio.md, "Speech output"): the qwen-tts 0.1.1 package's model code imports only with
# transformers 4.57.x (its pin; transformers 5 changed `check_model_inputs`), while the main environment tracks
# transformers 5, so its tests run in a separate virtual environment built here as an overlay of the main one: it
# sees the main environment's packages (CPU torch 2.13.0, polyrl's dependencies) behind its own, which are polyrl's
# `tts` extra (transformers 4.57.3 with the huggingface-hub / tokenizers it pins, a diffusers that accepts that hub,
# and what the package's model modules import: librosa, soundfile, einops) and qwen-tts without its declared
# dependencies (torchaudio has no build for torch 2.13 and would pull another torch; gradio is its demo's;
# accelerate, sox and onnxruntime are not needed by the 12 Hz models: polyrl/models/qwen3_tts.py). No torch is
# installed here.
#
#   bash scripts/ci_qwen_tts.sh           # builds ${TMPDIR:-/tmp}/polyrl-qwen-tts-env (reused while this script,
#                                         # pyproject.toml, the main environment and this checkout's path are
#                                         # unchanged: polyrl is installed from it), then runs tests/test_qwen3_tts.py
#   POLYRL_QWEN_TTS_ENV=/path PYTHON=/path/to/main/python bash scripts/ci_qwen_tts.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
BASE_PY="${PYTHON:-python}"
ENV_DIR="${POLYRL_QWEN_TTS_ENV:-${TMPDIR:-/tmp}/polyrl-qwen-tts-env}"
PY="$ENV_DIR/bin/python"
STAMP="$ENV_DIR/.polyrl-qwen-tts-ready"
# the main environment's site directories (pure and platform packages, where a system Python keeps them apart)
BASE_SITE="$("$BASE_PY" -c 'import site; print(repr(site.getsitepackages()))')"
WANT="$( (cat "$0" pyproject.toml; echo "$BASE_SITE $PWD") | sha256sum | cut -c1-16)"
start=$SECONDS

if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    echo "ci_qwen_tts: building $ENV_DIR over $BASE_SITE"
    "$BASE_PY" -m venv --clear "$ENV_DIR"
    SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # the main environment's site-packages after this one's (its .pth files too: polyrl's editable install)
    echo "import site; list(map(site.addsitedir, $BASE_SITE))" > "$SITE/zz_polyrl_main_env.pth"
    # the main environment's torch must be the one seen here: pip would otherwise install a (CUDA) torch
    "$PY" -c "import torch" || { echo "ci_qwen_tts: the main environment's torch is not visible from $ENV_DIR"; exit 1; }
    "$PY" -m pip install -q -e ".[tts]"  # polyrl's tts extra: transformers 4.57.3, librosa, soundfile, einops
    "$PY" -m pip install -q --no-deps qwen-tts==0.1.1
    "$PY" - <<'EOC'
import importlib.util
import torch
import transformers
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, f"not the CPU torch 2.13.0: {torch.__version__}"
assert transformers.__version__ == "4.57.3", transformers.__version__
extra = [m for m in ("torchaudio", "gradio") if importlib.util.find_spec(m)]
assert not extra, f"installed but not wanted: {extra}"
EOC
    echo "$WANT" > "$STAMP"
fi
echo "ci_qwen_tts: environment ready after $((SECONDS - start)) s"
# POLYRL_REQUIRE_QWEN_TTS: here a qwen-tts that does not import fails the test file instead of skipping its cases
PYTHONPATH="$PWD" POLYRL_REQUIRE_QWEN_TTS=1 OMP_NUM_THREADS=1 "$PY" -m pytest -q tests/test_qwen3_tts.py
echo "ci_qwen_tts: done in $((SECONDS - start)) s"
