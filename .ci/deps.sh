# Sourced by .ci/run and .ci/demo: installs the Debian packages effattn needs when missing.
# Usage: effattn_ensure_packages pkg...
effattn_ensure_packages() {
  local missing=()
  local p
  for p in "$@"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "effattn: installing missing packages: ${missing[*]}" >&2
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
      echo "effattn: need root (or sudo) to install: ${missing[*]}" >&2
      return 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y --no-install-recommends "${missing[@]}" ||
    { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends "${missing[@]}"; }
}

EFFATTN_PACKAGES=(cmake g++ make pkg-config libeigen3-dev libfftw3-dev catch2 libbenchmark-dev)
# OpenMPI for effattn::mpi and its tests (test_mpi under mpirun; .ci/run installs it, the demo
# does not need it).
EFFATTN_MPI_PACKAGES=(libopenmpi-dev openmpi-bin)
# The Python module (EFFATTN_BUILD_PYTHON, presets python and ci-python) and its tests.
EFFATTN_PYTHON_PACKAGES=(pybind11-dev python3-pybind11 python3-numpy python3-pytest python3-pip python3-venv)
# The asan and tsan presets' compiler (clang: it builds the Eigen-heavy tests under ASan + UBSan in
# about half the CPU time of g++), its sanitizer runtimes and OpenMP runtime; the fuzz targets use
# them too.
EFFATTN_CLANG_PACKAGES=(clang libclang-rt-dev libomp-dev)
