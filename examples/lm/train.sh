#!/usr/bin/env bash
# Trains both effattn-lm models from scratch, offline, in one command (45 min on 2
# cores): installs the Debian packages it needs (python3-torch; bible-kjv and bible-kjv-text for
# the text; libopenblas0-pthread, which Debian's torch then uses as its BLAS instead of the
# reference BLAS, about 25x faster here), then runs examples/lm/train.py --model all, which
# rewrites examples/lm/{weights,fixtures,data,reference.json}. CI never runs this.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source .ci/deps.sh
effattn_ensure_packages python3-torch bible-kjv bible-kjv-text libopenblas0-pthread
exec /usr/bin/python3 examples/lm/train.py --model all "$@"
