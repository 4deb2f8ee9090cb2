#!/usr/bin/env bash
# Compile cost of effattn for a user, measured as a user meets it: the consumer project
# (tests/consumer) built against an installed effattn with g++ -O2 -fopenmp, one compilation at
# a time, each timed by /usr/bin/time (wall seconds, peak resident memory):
#   main.cpp (calls all seven functors once, float, defaults) header-only   -> effattn_consumer
#   the same TU against effattn::compiled                                   -> ..._compiled
#   the same TU against effattn::headers (no FFTW), calling only exact attention and
#   Conv-Basis (the FFT user), to check the GPL opt-out                     -> ..._nofftw
#   an <Eigen/Dense>-only TU with one GEMM, the yardstick, compiled first, between and last
#   (the median of the three is the base of the ratios)                     -> eigen_only{,_2,_3}
# then runs the three consumers (each checks its results). Prints a table with the ratios to
# the Eigen-only TU and the targets (header-only <= 10x and <= 1.5 GB, compiled <= 3x).
#   bash bench/compile_cost.sh PREFIX [BUILD_DIR]      (PREFIX: where effattn is installed)
set -euo pipefail
prefix=$(realpath "$1")
build=${2:-build/compile_cost}
rm -rf "$build"
mkdir -p "$build"
times="$(realpath "$build")/times.txt"
cmake -S "$(dirname "${BASH_SOURCE[0]}")/../tests/consumer" -B "$build" \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE=-O2 \
  -DCMAKE_CXX_FLAGS="-fopenmp -Wall -Wextra -Werror" \
  -DCMAKE_CXX_COMPILER_LAUNCHER="/usr/bin/time;-f;TIME %e %M %C;-a;-o;$times" >/dev/null
cmake --build "$build" -j1 >/dev/null
for exe in effattn_consumer effattn_consumer_compiled effattn_consumer_nofftw; do
  [ -x "$build/$exe" ] && "$build/$exe"
done
python3 - "$times" <<'PY'
import re, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"TIME (\S+) (\d+) (.*)", line)
    if not m:
        continue
    t = re.search(r"CMakeFiles/([^/]+)\.dir/", m.group(3))
    if t:
        rows[t.group(1)] = (float(m.group(1)), int(m.group(2)) / 1024.0)
# The yardstick is compiled three times (first, between, last); its median is the base.
yard = sorted(rows[n] for n in ["eigen_only", "eigen_only_2", "eigen_only_3"] if n in rows)
rows["eigen_only"] = yard[len(yard) // 2]
base = rows["eigen_only"][0]
print(f"{'translation unit':<28} {'seconds':>8} {'peak MB':>8} {'x Eigen-only':>13}")
for name in ["eigen_only", "effattn_consumer", "effattn_consumer_nofftw", "effattn_consumer_compiled"]:
    if name == "eigen_only":
        print(f"{'eigen_only':<28} {base:8.1f} {rows[name][1]:8.0f} {1.0:13.1f}"
              f"  (median of {', '.join(f'{y[0]:.1f}' for y in yard)} s)")
    elif name in rows:
        s, mb = rows[name]
        print(f"{name:<28} {s:8.1f} {mb:8.0f} {s / base:13.1f}")
h = rows["effattn_consumer"]
print(f"bar header-only <= 10x and <= 1536 MB: {'met' if h[0] <= 10 * base and h[1] <= 1536 else 'MISSED'}")
if "effattn_consumer_compiled" in rows:
    c = rows["effattn_consumer_compiled"]
    print(f"bar compiled <= 3x: {'met' if c[0] <= 3 * base else 'MISSED'}")
PY
