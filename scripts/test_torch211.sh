#!/usr/bin/env bash
# The GPU image's versions on the CPU: torch 2.11 + Triton 3.6 + transformers 5.17, in a cached virtual
# environment, running the pagedkernels tests (the custom ops' opcheck and fullgraph
# inductor compiles included) and the engine tests that need no server extras.
#
#   bash scripts/test_torch211.sh                     the whole tier: tests/pagedkernels and tests/engine
#   bash scripts/test_torch211.sh --ci [pytest args]  the part CI runs: tests/pagedkernels, tests/engine/test_custom_ops.py
#   bash scripts/test_torch211.sh PYTEST_ARGS...      those tests instead
#
# The environment lives in $PAGEDKERNELS_CACHE_DIR (default ~/.cache/pagedkernels)/venv-torch2.11-triton3.6-pyX.Y
# and is reused while its requirements (the stamp below) are unchanged; a changed requirement or a failed
# install rebuilds it from scratch. The checkout is put on PYTHONPATH rather than installed, so one cached
# environment serves any checkout. Neither the serve extra nor gguf/xgrammar/accelerate is installed: the test
# modules that need them skip with a reason (pytest -ra lists them). PYTHON picks the interpreter (default
# python3; the GPU image runs 3.12, this tier is meant for whatever 3.10+ the machine has).
#
# Timing lines ("tier: ...") go to stderr; the exit status is pytest's (or the install's).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO_ROOT=$PWD

PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
TORCH_SPEC="torch==2.11.*"
TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The GPU image's pins; the other runtime dependencies of pyproject.toml are left to pip's newest, but for
# numpy: Triton 3.6's interpreter (which runs the kernels on CPU tensors in the tests) converts 1-element
# arrays to ints, which numpy 2.4 made a TypeError (every interpreted attention test fails with it).
REQUIREMENTS=("triton==3.6.*" "transformers==5.17.*" "numpy<2.4" "safetensors>=0.4" "tokenizers>=0.19" "jinja2"
              "tqdm" "pytest>=8" "pytest-xdist" "hypothesis")
PY_VERSION=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
CACHE_DIR=${PAGEDKERNELS_CACHE_DIR:-$HOME/.cache/pagedkernels}
VENV=$CACHE_DIR/venv-torch2.11-triton3.6-py$PY_VERSION
STAMP="$TORCH_SPEC $TORCH_INDEX ${REQUIREMENTS[*]}"

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }'; }

start=$(now)
if [[ -f $VENV/.stamp && $(cat "$VENV/.stamp") == "$STAMP" ]] && "$VENV/bin/python" -c "import torch, triton" 2>/dev/null; then
    echo "tier: reusing $VENV ($(elapsed "$start") s)" >&2
else
    echo "tier: creating $VENV" >&2
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
    # torch first, then the rest constrained to it so that nothing replaces it. PyTorch's CPU index has the small
    # CPU build; where that index cannot be reached, PyPI's (the CUDA 13 build: ~3 GB with its CUDA libraries,
    # which runs on a CPU-only machine all the same).
    if "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=10)" \
            "$TORCH_INDEX" 2>/dev/null; then
        "${pip[@]}" "$TORCH_SPEC" --index-url "$TORCH_INDEX"
    else
        echo "tier: $TORCH_INDEX is unreachable; installing PyPI's $TORCH_SPEC (the CUDA build)" >&2
        "${pip[@]}" "$TORCH_SPEC"
    fi
    "$VENV/bin/python" -c "import torch; print(f'torch=={torch.__version__}')" > "$VENV/torch-constraint.txt"
    "${pip[@]}" -c "$VENV/torch-constraint.txt" "${REQUIREMENTS[@]}"
    printf '%s' "$STAMP" > "$VENV/.stamp"
    echo "tier: installed in $(elapsed "$start") s" >&2
fi
"$VENV/bin/python" -c "import sys, torch, triton, transformers; print(f'tier: python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}')" >&2

# The ahead-of-time compile of every launch with Triton 3.6 is already part of the main suite
# (tests/pagedkernels/test_aot_compile.py installs that Triton beside the local one); its recording tests
# still run here.
AOT_COMPILE=tests/pagedkernels/test_aot_compile.py::test_every_launch_compiles_for_sm90_and_sm80
if [[ ${1:-} == --ci ]]; then
    # What .ci/run runs: the kernels and every custom op (opcheck, fullgraph inductor), the parts where torch
    # and Triton versions differ; .ci/run adds two workers (-n 2 --dist loadscope): 3 min on a slow 2-core Zen 3.
    shift
    # CI: where the two torch/Triton pairs differ, the Triton kernels (the interpreter's cases, and the tests that
    # force the Triton backend: marker triton) and the custom ops (opcheck, fullgraph compile, the AOT table's
    # tests); the native C kernels and the PyTorch twins run the same code under both and stay in the full tier.
    set -- tests/pagedkernels tests/engine/test_custom_ops.py --deselect "$AOT_COMPILE" \
        -k "triton or custom_ops or torch_ops or aot" "$@"
elif [[ $# -eq 0 ]]; then
    set -- tests/pagedkernels tests/engine --deselect "$AOT_COMPILE"
fi
start=$(now)
status=0
# numpy 2.3 still warns where 2.4 fails (see REQUIREMENTS), once per interpreted launch: not the tests' concern.
PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    -W "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning" "$@" || status=$?
echo "tier: pytest took $(elapsed "$start") s (exit $status)" >&2
exit $status
