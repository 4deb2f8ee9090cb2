#!/usr/bin/env bash
# The scaling sweep: runs every benchmark executable's scaling families (n = 1024 ... 65536;
# exact attention up to 16384 where the benchmark allows choosing) with JSON output, writes the
# machine description beside the JSON, then the plots (bench/plot.py, needs python3-matplotlib).
#
#   bash bench/sweep.sh [BUILD_DIR=build/release] [OUT_DIR=bench/results]
#
# Takes about 20-40 minutes on 2 cores. Build first: cmake --workflow --preset release.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${1:-build/release}
out=${2:-bench/results}
mkdir -p "$out"

# Each method benchmark times its own exact baseline in the same process, so the ratios it
# reports are within one run.
run() {  # run NAME FILTER
  local name=$1 filter=$2 bin="$build/bench/$1"
  [[ -x $bin ]] || { echo "sweep: $bin not built, skipped" >&2; return 0; }
  echo "sweep: $name ($filter)" >&2
  "$bin" --benchmark_filter="$filter" --benchmark_min_time=0.1 \
    --benchmark_out="$out/$name.json" --benchmark_out_format=json > "$out/$name.txt"
}
run bench_exact 'exact/tiled/float/d64/(full|causal)/tall/'
run bench_eva '^(exact/tiled|eva|performer)/float'
run bench_vcc '^(exact/tiled|exactvip|vcc/(twolevel|bestfirst))/'
run bench_wildcat '^(exact/|wildcat/float|wildcat-headline/|shape/)'
run bench_conv_basis '^(exact|conv_basis)/'
run bench_kep_svgp '^(exact/|kep_svgp/(randomized|dense|factorized)/|sgpa/)'

{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  echo "cores: $(nproc)"
  echo "compiler: $(c++ --version | head -1)"
  echo "flags: $(grep -E '^CMAKE_CXX_FLAGS(_RELEASE)?:' "$build/CMakeCache.txt" | tr '\n' ' ')"
  echo "openmp threads: ${OMP_NUM_THREADS:-$(nproc)}"
  echo "eigen: $(awk '/define EIGEN_(WORLD|MAJOR|MINOR)_VERSION/ {v = v (v == "" ? "" : ".") $3} END {print v}' /usr/include/eigen3/Eigen/src/Core/util/Macros.h)"
  echo "note: shared virtual machine; compare ratios within one benchmark run, not absolute times"
} > "$out/machine.txt"

"${PYTHON:-/usr/bin/python3}" bench/plot.py "$out"
