#!/usr/bin/env bash
# Compile cost of effattn for a user, measured as a user meets it: the consumer project
# (tests/consumer) built against an installed effattn with g++ -O2 -fopenmp, one compilation at
# a time, each timed by /usr/bin/time (wall seconds, peak resident memory):
#   method_<name>: per method (exact, conv_basis, vcc, eva, performer, wildcat, kep_svgp, auto,
#   multi_head), a TU with only that method's header calling its default float functor once,
#   header-only (method.cpp)                                                -> method_<name>
#   main.cpp (the umbrella header, all seven functors called once, float, defaults) against
#   effattn::compiled                                                       -> ..._compiled
#   the same TU against effattn::headers (no FFTW), calling only exact attention and
#   Conv-Basis (the FFT user), to check the GPL opt-out                     -> ..._nofftw
#   an <Eigen/Dense>-only TU with one GEMM, the yardstick, compiled first, in the middle and
#   last (the median of the three is the base of the ratios)                -> eigen_only{,_2,_3}
# then runs the consumers (each checks its results) and prints the table of bench/compile_cost.py:
# seconds, ratio to the Eigen-only TU, peak MB, and the targets (each header-only method TU <= 10x
# and <= 1.5 GB, the compiled TU <= 3x). 15 compilations; the nine method TUs took about 100 s
# of the run's 150 s on the reference machine (docs/building.md).
#   bash bench/compile_cost.sh PREFIX [BUILD_DIR [compile_cost.py options]]
# PREFIX: where effattn is installed; the options (--out JSON, --render DOC) are passed on.
set -euo pipefail
prefix=$(realpath "$1")
build=${2:-build/compile_cost}
shift $(($# < 2 ? $# : 2))
here=$(dirname "${BASH_SOURCE[0]}")
rm -rf "$build"
mkdir -p "$build"
times="$(realpath "$build")/times.txt"
cmake -S "$here/../tests/consumer" -B "$build" \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE=-O2 \
  -DCMAKE_CXX_FLAGS="-fopenmp -Wall -Wextra -Werror" \
  -DCMAKE_CXX_COMPILER_LAUNCHER="/usr/bin/time;-f;TIME %e %U %S %M %C;-a;-o;$times" >/dev/null
cmake --build "$build" -j1 >/dev/null
for exe in "$build"/method_* "$build"/effattn_consumer_compiled "$build"/effattn_consumer_nofftw; do
  if [ -x "$exe" ]; then "$exe"; fi
done
python3 "$here/compile_cost.py" "$build" "$@"
