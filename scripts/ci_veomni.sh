#!/usr/bin/env bash
# CI for actor.backend=veomni (docs/distributed.md, "VeOmni"): VeOmni 0.1.12 imports only with transformers < 5.23,
# while the main environment tracks newer transformers, so its test runs in a separate virtual environment built
# here: CPU torch 2.13.0, VeOmni without its declared dependencies (timm pulls a CUDA torchvision, wandb and the old
# datasets / packaging / torchdata pins are not needed by the modules polyrl imports), only the packages those
# modules import, transformers < 5.23, and polyrl from this checkout with its own dependencies.
#
#   bash scripts/ci_veomni.sh            # builds ${TMPDIR:-/tmp}/polyrl-veomni-env (reused while this script and
#                                        # pyproject.toml are unchanged), then runs tests/test_veomni_backend.py
#   POLYRL_VEOMNI_ENV=/path bash scripts/ci_veomni.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
ENV_DIR="${POLYRL_VEOMNI_ENV:-${TMPDIR:-/tmp}/polyrl-veomni-env}"
PY="$ENV_DIR/bin/python"
STAMP="$ENV_DIR/.polyrl-veomni-ready"
WANT="$(cat "$0" pyproject.toml | sha256sum | cut -c1-16)"
start=$SECONDS

if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    echo "ci_veomni: building $ENV_DIR"
    "${PYTHON:-python}" -m venv --clear "$ENV_DIR"
    cat > "$ENV_DIR/constraints.txt" <<'EOF'
torch==2.13.0
transformers>=5.9.0,<5.23
EOF
    # what VeOmni's parallel modules import beyond polyrl's own dependencies: datasets (veomni.data, imported by
    # the package), torchdata (< 1.0: its stateful dataloader), psutil
    "$PY" -m pip install -q -c "$ENV_DIR/constraints.txt" torch==2.13.0 "transformers>=5.9.0,<5.23" \
        "datasets>=2.16" "torchdata<1.0" psutil pytest -e .
    "$PY" -m pip install -q --no-deps veomni==0.1.12
    "$PY" - <<'EOF'
import importlib.util
import torch
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, f"not the CPU torch 2.13.0: {torch.__version__}"
extra = [m for m in ("torchvision", "timm", "wandb") if importlib.util.find_spec(m)]
assert not extra, f"installed but not wanted: {extra}"
EOF
    echo "$WANT" > "$STAMP"
fi
echo "ci_veomni: environment ready after $((SECONDS - start)) s"
# POLYRL_REQUIRE_VEOMNI: here a VeOmni that does not import fails the test file instead of skipping its cases
POLYRL_REQUIRE_VEOMNI=1 OMP_NUM_THREADS=1 "$PY" -m pytest -q tests/test_veomni_backend.py
echo "ci_veomni: done in $((SECONDS - start)) s"
