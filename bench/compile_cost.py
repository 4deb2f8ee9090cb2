"""The table of bench/compile_cost.sh, from the times its compiler launcher recorded.

    python3 bench/compile_cost.py BUILD_DIR [--out JSON] [--render DOC]
    python3 bench/compile_cost.py --from-json JSON --render DOC

BUILD_DIR is the consumer build of compile_cost.sh (its times.txt: one line per compilation,
"TIME <wall s> <user s> <system s> <peak KB> <command>"). Prints, per translation unit, the
compiler's CPU seconds (user + system, its child processes included) and wall seconds, the
ratio of the CPU seconds to the Eigen-only yardstick's (the median of its compilations in the
same run), the peak resident memory and whether it meets its target: each header-only method TU
<= 10x the yardstick and <= 1.5 GB, the compiled-mode TU (every method in one file) <= 3x. The
ratios use CPU time, which another job on the same machine leaves almost unchanged (the wall
time of a compilation that shares its core grows with the other job's load; on a free core the
two agree). --out writes the rows and
the machine (CPU model, cores, compiler) as JSON; --render writes the table between the
<!-- compile-cost:begin --> and <!-- compile-cost:end --> markers of DOC (docs/building.md).
Standard library only (CI runs it with the system python3)."""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "lm"))
from doc_markers import write_between_markers  # noqa: E402

YARDSTICKS = ["eigen_only", "eigen_only_2", "eigen_only_3"]
HEADER_ONLY_TARGET, COMPILED_TARGET, HEADER_ONLY_MB = 10.0, 3.0, 1536.0
# Per-method TUs (tests/consumer/method.cpp): target suffix, public header, functor. AutoAttention
# chooses among the methods at run time, so its TU instantiates every method: it is listed, not
# held to the per-method target (AUTO).
AUTO = "auto"
METHODS = [
    ("exact", "exact.hpp", "ExactAttentionf"),
    ("conv_basis", "conv_basis.hpp", "ConvBasisAttentionf"),
    ("vcc", "vcc.hpp", "VccAttentionf"),
    ("eva", "eva.hpp", "EvaAttentionf"),
    ("performer", "eva.hpp", "PerformerAttentionf"),
    ("wildcat", "wildcat.hpp", "WildcatAttentionf"),
    ("kep_svgp", "kep_svgp.hpp", "KepSvgpAttentionf"),
    ("auto", "auto.hpp", "AutoAttentionf"),
    ("multi_head", "multi_head.hpp", "MultiHead<ExactAttentionf>"),
]


def read_times(build):
    times = {}
    with open(os.path.join(build, "times.txt")) as f:
        for line in f:
            m = re.match(r"TIME (\S+) (\S+) (\S+) (\d+) (.*)", line)
            t = m and re.search(r"CMakeFiles/([^/]+)\.dir/", m.group(5))
            if t:
                wall, user, system = (float(m.group(i)) for i in (1, 2, 3))
                times[t.group(1)] = {"seconds": user + system, "wall_seconds": wall,
                                     "peak_mb": int(m.group(4)) / 1024.0}
    return times


def compiler(build):
    cxx = "c++"
    with open(os.path.join(build, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith("CMAKE_CXX_COMPILER:"):
                cxx = line.split("=", 1)[1].strip()
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else cxx


def machine(build):
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "compiler": compiler(build),
            "flags": "-O2 -fopenmp"}


def result(build):
    times = read_times(build)
    yard = sorted((times[n] for n in YARDSTICKS if n in times), key=lambda t: t["seconds"])
    if not yard:
        sys.exit("compile_cost.py: no Eigen-only compilation in times.txt")
    median = yard[len(yard) // 2]  # the compilation with the median CPU time
    base = median["seconds"]
    rows = [dict(tu="eigen_only", what="<Eigen/Dense>, one GEMM (the yardstick)",
                 mode="Eigen only", ratio=1.0, **median)]

    def row(tu, what, mode, target, max_mb=None):
        if tu not in times:
            return
        t = times[tu]
        r = dict(tu=tu, what=what, mode=mode, ratio=t["seconds"] / base, **t)
        if target is not None:
            r["target_ratio"] = target
            if max_mb is not None:
                r["target_peak_mb"] = max_mb
            r["met"] = r["ratio"] <= target and (max_mb is None or t["peak_mb"] <= max_mb)
        rows.append(r)

    for name, header, functor in METHODS:
        if name == AUTO:
            row(f"method_{name}", f"<effattn/{header}>, {functor} (every method inside)",
                "header-only", None)
        else:
            row(f"method_{name}", f"<effattn/{header}>, {functor}", "header-only",
                HEADER_ONLY_TARGET, HEADER_ONLY_MB)
    row("effattn_consumer_nofftw", "<effattn/effattn.hpp>, exact and Conv-Basis, no FFTW",
        "header-only", None)
    row("effattn_consumer_compiled", "<effattn/effattn.hpp>, all seven functors", "compiled",
        COMPILED_TARGET)
    return {"what": "compile cost of user translation units (bench/compile_cost.sh)",
            "date": datetime.date.today().isoformat(), "machine": machine(build),
            "yardstick_seconds": [t["seconds"] for t in yard], "rows": rows}


def status(r):
    if "met" not in r:
        return ""
    target = f"<= {r['target_ratio']:g}x" + (" and 1.5 GB" if "target_peak_mb" in r else "")
    return f"{target}: {'met' if r['met'] else 'MISSED'}"


def print_table(res):
    print(f"{'translation unit':<27} {'CPU s':>7} {'wall s':>7} {'x Eigen-only':>12} "
          f"{'peak MB':>8}  target")
    for r in res["rows"]:
        extra = ""
        if r["tu"] == "eigen_only":
            extra = "median of " + ", ".join(f"{y:.1f}" for y in res["yardstick_seconds"]) + " s"
        print(f"{r['tu']:<27} {r['seconds']:7.1f} {r['wall_seconds']:7.1f} {r['ratio']:12.1f} "
              f"{r['peak_mb']:8.0f}  {status(r) or extra}")
    missed = [r["tu"] for r in res["rows"] if r.get("met") is False]
    print("targets: " + ("all met" if not missed else "MISSED by " + ", ".join(missed)))


def render(res, doc):
    m = res["machine"]
    lines = [f"{m['compiler']}, `{m['flags']}`; {m['cpu']}, {m['cores']} cores "
             f"(`bench/results/compile_cost.json`). Seconds: the compiler's CPU time (user +"
             " system); the ratio is to the Eigen-only TU's.", "",
             "| translation unit (`tests/consumer`) | mode | CPU seconds | x Eigen-only | peak MB "
             "| target |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        # Headers and functors as code (a bare <...> would read as an HTML tag in Doxygen).
        what = re.sub(r"(<[\w/.]+>)", r"`\1`", r["what"], count=1)
        what = re.sub(r", ([A-Z]\w+(?:<\w+>)?)", r", `\1`", what)
        lines.append(f"| {what} | {r['mode']} | {r['seconds']:.1f} | {r['ratio']:.1f} | "
                     f"{r['peak_mb']:.0f} | {status(r)} |")
    write_between_markers(doc, "compile-cost", lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", nargs="?", help="the consumer build directory of compile_cost.sh")
    ap.add_argument("--out", metavar="JSON", help="write the result as JSON")
    ap.add_argument("--render", metavar="DOC", help="render the table into DOC")
    ap.add_argument("--from-json", metavar="JSON", help="use this result instead of BUILD")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
    elif args.build:
        res = result(args.build)
    else:
        ap.error("BUILD or --from-json is required")
    print_table(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    if args.render:
        render(res, args.render)


if __name__ == "__main__":
    main()
