"""The PEP 517 build backend of ``pip install --no-build-isolation .`` (pyproject.toml).

It needs nothing beyond the standard library and the Debian packages the CMake build uses
(cmake, g++, libeigen3-dev, libfftw3-dev, pybind11-dev): it configures the repository with
CMake (the Python module only: tests, examples and benchmarks off), builds the target
``effattn_python`` and packs the package directory ``<build>/python/effattn`` into a wheel.

Config settings (``pip install --config-settings KEY=VALUE``):

``build-dir``
    The CMake build tree. Default ``build/pip`` under the repository (kept, so a second install
    only rebuilds what changed). An existing, configured tree given here is built as it is
    configured (no options are changed): CI installs the module it has already built.
``cmake-args``
    Extra ``cmake`` configure arguments, separated by spaces (default
    ``-DCMAKE_CXX_FLAGS=-march=native``: the module is built for the machine it installs on; pass
    ``cmake-args=`` for a portable build).
``jobs``
    Parallel build jobs (default: the number of CPUs).
"""

import base64
import hashlib
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import zipfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NAME = "effattn"


def _version():
    with open(os.path.join(_ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        m = re.search(r"project\(\s*effattn\b[^)]*?VERSION\s+([0-9.]+)", f.read(), re.S)
    if not m:
        raise RuntimeError("effattn build backend: no VERSION in CMakeLists.txt's project()")
    return m.group(1)


def _tag():
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"{py}-{py}-{plat}"


def _dist_info():
    return f"{_NAME}-{_version()}.dist-info"


def _metadata():
    readme = ""
    path = os.path.join(_ROOT, "README.md")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            readme = f.read()
    return (
        "Metadata-Version: 2.1\n"
        f"Name: {_NAME}\n"
        f"Version: {_version()}\n"
        "Summary: Fast exact and approximate softmax attention on the CPU (C++17 / Eigen), "
        "with PyTorch autograd support\n"
        "License: MIT (the compiled module links FFTW, GPL-2.0-or-later)\n"
        "Requires-Python: >=3.8\n"
        "Requires-Dist: numpy\n"
        "Provides-Extra: torch\n"
        'Requires-Dist: torch; extra == "torch"\n'
        "Description-Content-Type: text/markdown\n"
        "\n" + readme
    )


def _wheel_file():
    return (
        "Wheel-Version: 1.0\n"
        "Generator: effattn build_backend\n"
        "Root-Is-Purelib: false\n"
        f"Tag: {_tag()}\n"
    )


def _setting(config_settings, key, default):
    if not config_settings or key not in config_settings:
        return default
    value = config_settings[key]
    return value[-1] if isinstance(value, list) else value


def _run(cmd):
    print("effattn build backend:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=_ROOT)


def _build(config_settings):
    """Configures (unless an existing tree was given) and builds; returns the package dir."""
    given = _setting(config_settings, "build-dir", None)
    build_dir = os.path.abspath(os.path.join(_ROOT, given or os.path.join("build", "pip")))
    jobs = str(_setting(config_settings, "jobs", os.cpu_count() or 1))
    configured = os.path.exists(os.path.join(build_dir, "CMakeCache.txt"))
    if not (given and configured):
        extra = shlex.split(_setting(config_settings, "cmake-args", "-DCMAKE_CXX_FLAGS=-march=native"))
        _run(
            ["cmake", "-S", _ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
             "-DEFFATTN_BUILD_PYTHON=ON", "-DEFFATTN_BUILD_COMPILED=ON",
             "-DEFFATTN_BUILD_TESTS=OFF", "-DEFFATTN_BUILD_EXAMPLES=OFF",
             "-DEFFATTN_BUILD_BENCHMARKS=OFF", "-DEFFATTN_INSTALL=OFF",
             f"-DPython_EXECUTABLE={sys.executable}"] + extra
        )
    _run(["cmake", "--build", build_dir, "--target", "effattn_python", "-j", jobs])
    pkg = os.path.join(build_dir, "python", _NAME)
    if not any(f.startswith("_effattn") for f in os.listdir(pkg)):
        raise RuntimeError(f"effattn build backend: no extension module in {pkg}")
    return pkg


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def _write_wheel(wheel_directory, files):
    """files: (arcname, bytes) pairs; adds the dist-info and RECORD; returns the wheel's name."""
    info = _dist_info()
    files = list(files) + [
        (f"{info}/METADATA", _metadata().encode()),
        (f"{info}/WHEEL", _wheel_file().encode()),
        (f"{info}/top_level.txt", f"{_NAME}\n".encode()),
    ]
    name = f"{_NAME}-{_version()}-{_tag()}.whl"
    os.makedirs(wheel_directory, exist_ok=True)
    record = [_record_line(a, d) for a, d in files] + [f"{info}/RECORD,,"]
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        for arcname, data in files:
            z.writestr(arcname, data)
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return name


def _package_files(pkg):
    out = []
    for f in sorted(os.listdir(pkg)):
        path = os.path.join(pkg, f)
        if os.path.isfile(path) and (f.endswith((".py", ".pyi", ".so")) or f == "py.typed"):
            with open(path, "rb") as fh:
                out.append((f"{_NAME}/{f}", fh.read()))
    return out


# ------------------------------------------------------------------------------------------
# PEP 517 / 660 hooks


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    info = os.path.join(metadata_directory, _dist_info())
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as f:
        f.write(_metadata())
    with open(os.path.join(info, "WHEEL"), "w", encoding="utf-8") as f:
        f.write(_wheel_file())
    return _dist_info()


prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, _package_files(_build(config_settings)))


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """An editable install: a .pth file naming the build tree's package directory (rebuild
    with ``cmake --build <build-dir> --target effattn_python`` after changing C++ code; the
    Python files are copied there by that build)."""
    pkg = _build(config_settings)
    return _write_wheel(wheel_directory, [(f"{_NAME}_editable.pth", (os.path.dirname(pkg) + "\n").encode())])
