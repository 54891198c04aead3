#!/usr/bin/env bash
# The default model's GGUF (SmolLM2-135M-Instruct, Q4_1, 94 MiB) to a lent GPU machine, which reaches no network
# and takes at most 64 MiB a call (the working tree included): in two halves, over two calls to one warm machine.
# The GPU suite's phase 14 (speculative decoding on real weights) needs it.
#
#   bash scripts/gpu_carry_model.sh prepare      here: .carry/model-a (first half + the gguf wheel, which the GPU
#                                                image lacks) and .carry/model-b (second half + its checksum); prints
#                                                the two calls
#   bash scripts/gpu_carry_model.sh unpack a     there, call 1 (carry .carry/model-a): the half into /tmp/engine-model
#   bash scripts/gpu_carry_model.sh unpack b     there, call 2 (carry .carry/model-b), while the machine is still warm:
#                                                the file whole in $ENGINE_CACHE_DIR (default /tmp/engine-cache), its
#                                                checksum checked, gguf installed into /tmp/gguf-site
#
# The first use of the default model on that machine (phase 14) converts the GGUF to a bf16 directory with
# transformers, as it does here.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/engine-model
CACHE=${ENGINE_CACHE_DIR:-/tmp/engine-cache}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf

case "${1:-}" in
prepare)
    gguf=$(python -m engine.default_model --gguf | tail -1)
    rm -rf .carry/model-a .carry/model-b
    mkdir -p .carry/model-a .carry/model-b
    size=$(stat -c %s "$gguf")
    half=$(( (size + 1) / 2 ))
    head -c "$half" "$gguf" > .carry/model-a/gguf.part1
    tail -c +"$(( half + 1 ))" "$gguf" > .carry/model-b/gguf.part2
    sha256sum "$gguf" | cut -d' ' -f1 > .carry/model-b/sha256
    version=$(python -c "import importlib.metadata as m; print(m.version('gguf'))")
    python -m pip download -q --no-deps --only-binary=:all: -d .carry/model-a "gguf==$version"
    du -sh .carry/model-a .carry/model-b
    cat <<EOF
Call 1 (carry [".carry/model-a"]), e.g. with phase 13:
  bash scripts/gpu_carry_model.sh unpack a && PYTHONPATH=. python -m bench.gpu_suite --phase 13 --out \$OUT
Call 2 (carry [".carry/model-b"]), on the same machine while it is warm (30 s idle):
  bash scripts/gpu_carry_model.sh unpack b && PYTHONPATH=/tmp/gguf-site:. ENGINE_CACHE_DIR=$CACHE python -m bench.gpu_suite --phase 14 --out \$OUT
EOF
    ;;
unpack)
    case "${2:-}" in
    a)
        mkdir -p "$STAGE"
        cp .carry/model-a/* "$STAGE"/
        echo "gpu_carry_model: first half in $STAGE ($(du -sh "$STAGE" | cut -f1))"
        ;;
    b)
        if [[ ! -f $STAGE/gguf.part1 ]]; then
            echo "gpu_carry_model: $STAGE/gguf.part1 is missing: call 1 (unpack a) did not run on this machine, or" \
                 "the machine was released between the calls" >&2
            exit 1
        fi
        mkdir -p "$CACHE"
        cat "$STAGE/gguf.part1" .carry/model-b/gguf.part2 > "$CACHE/$NAME.partial"
        if [[ $(sha256sum "$CACHE/$NAME.partial" | cut -d' ' -f1) != $(cat .carry/model-b/sha256) ]]; then
            echo "gpu_carry_model: the joined file's checksum differs from the original's" >&2
            exit 1
        fi
        mv "$CACHE/$NAME.partial" "$CACHE/$NAME"
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gguf-site "$STAGE"/gguf-*.whl
        echo "gpu_carry_model: $CACHE/$NAME whole; gguf in /tmp/gguf-site"
        ;;
    *) echo "usage: $0 unpack a|b" >&2; exit 2 ;;
    esac
    ;;
*)
    sed -n '2,16p' "$0" >&2
    exit 2
    ;;
esac
