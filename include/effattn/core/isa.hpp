/// \file isa.hpp
/// \brief Runtime choice of the bf16 kernel path: CPUID + XCR0 checks, the Linux AMX tile-data
/// permission, and the `EFFATTN_ISA` environment override.
///
/// The bf16 kernels of `policy::TiledBf16` exist in three versions:
/// - `"amx"`: Intel AMX (AMX-TILE + AMX-BF16, `tdpbf16ps` on 16 x 32 bf16 tiles);
/// - `"avx512bf16"`: AVX512-BF16 (`vdpbf16ps`, 16 fp32 lanes of bf16 pair dot products);
/// - `"generic"`: bf16 values widened to fp32 and multiplied by Eigen's GEMM (any CPU).
///
/// The ISA-specific functions are compiled with function target attributes, so neither users nor
/// the CMake package need `-march` flags; they run only after the checks below succeed. The path
/// is chosen once per process, at the first call of `active_isa()` (or of a bf16 kernel):
/// 1. CPUID leaf 7: AVX512F, BW, VL (EBX bits 16, 30, 31), AMX-BF16 (EDX bit 22), AMX-TILE
///    (EDX bit 24); leaf 7
///    sub-leaf 1: AVX512-BF16 (EAX bit 5); leaf 1: OSXSAVE (ECX bit 27).
/// 2. XCR0 (`xgetbv`): the OS saves the AVX-512 state (bits 1, 2, 5, 6, 7).
/// 3. AMX only: Linux grants the tile-data state on request
///    (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, once per process; without it the
///    first tile instruction raises SIGILL), and XCR0 bits 17 and 18 (tile config and data) are
///    set.
/// 4. The environment variable `EFFATTN_ISA` (`generic`, `avx512bf16` or `amx`) can only force a
///    LOWER path than the one detected; a higher or unknown value is ignored.
#pragma once

#include <cstdlib>
#include <cstring>
#include <initializer_list>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11) && !defined(EFFATTN_NO_BF16_ISA)
/// 1 when the x86 bf16 kernels (AMX, AVX512-BF16) are compiled in (GCC >= 11 or Clang >= 12 on
/// x86-64; define `EFFATTN_NO_BF16_ISA` to leave them out and keep only the generic path).
#define EFFATTN_BF16_X86 1
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
/// Target attribute of the AVX-512 helpers and fp32 kernels: AVX512F/BW/VL, which every CPU with
/// AVX512-BF16 has (`detected_isa()` checks them before any of it runs).
#define EFFATTN_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#else
/// 0: the x86 bf16 kernels are not compiled in (not x86-64, an older compiler, or
/// `EFFATTN_NO_BF16_ISA`); TiledBf16 runs the generic path.
#define EFFATTN_BF16_X86 0
#endif

/// Full unrolling (up to 8 iterations) of the register blocks of the x86 kernels: without it GCC
/// at -O2 (the CI preset; -O3 unrolls by itself) keeps the accumulators in memory, a load and a
/// store around every FMA or `vdpbf16ps` (measured: WildCat's bf16 coreset attention 1.5x slower
/// at -O2).
#if defined(__clang__)
#define EFFATTN_UNROLL8 _Pragma("unroll 8")
#elif defined(__GNUC__)
#define EFFATTN_UNROLL8 _Pragma("GCC unroll 8")
#else
#define EFFATTN_UNROLL8
#endif

/// `EFFATTN_UNROLL8` for loops of up to 16 iterations (the 16 accumulators of the bf16 decoding
/// kernel's value pass).
#if defined(__clang__)
#define EFFATTN_UNROLL16 _Pragma("unroll 16")
#elif defined(__GNUC__)
#define EFFATTN_UNROLL16 _Pragma("GCC unroll 16")
#else
#define EFFATTN_UNROLL16
#endif

namespace effattn {
namespace detail {

/// The bf16 kernel paths, lowest first (the order `EFFATTN_ISA` compares).
enum class Isa { Generic = 0, Avx512Bf16 = 1, Amx = 2 };

/// "generic", "avx512bf16" or "amx".
inline const char* isa_name(Isa isa) noexcept {
  switch (isa) {
    case Isa::Amx:
      return "amx";
    case Isa::Avx512Bf16:
      return "avx512bf16";
    case Isa::Generic:
      return "generic";
  }
  return "generic";
}

/// The path `detected` lowered by the value of `EFFATTN_ISA` (`env` may be null): a lower known
/// path replaces it, anything else leaves it. Pure; `selected_isa()` applies it once.
inline Isa apply_isa_override(Isa detected, const char* env) noexcept {
  if (env == nullptr) return detected;
  for (const Isa isa : {Isa::Generic, Isa::Avx512Bf16, Isa::Amx})
    if (std::strcmp(env, isa_name(isa)) == 0)
      return static_cast<int>(isa) < static_cast<int>(detected) ? isa : detected;
  return detected;
}

#if EFFATTN_BF16_X86
/// XCR0 (the OS-enabled state components); only call when CPUID reports OSXSAVE.
__attribute__((target("xsave"))) inline unsigned long long read_xcr0() noexcept {
  return _xgetbv(0);
}

/// Asks Linux for the AMX tile-data state (once per process) and reports whether it is granted.
inline bool request_amx_permission() noexcept {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0) return false;
  return ((granted >> kXfeatureXtiledata) & 1ULL) != 0;
#else
  return false;  // tile state needs an OS that enables it; only Linux is supported
#endif
}
#endif

/// The highest bf16 path this CPU and OS support (ignores `EFFATTN_ISA`). Runs the checks of
/// the file documentation, including the AMX permission request, once per process.
inline Isa detected_isa() noexcept {
  static const Isa isa = []() noexcept {
#if EFFATTN_BF16_X86
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return Isa::Generic;  // OSXSAVE
    const unsigned long long xcr0 = read_xcr0();
    constexpr unsigned long long kAvx512State = (1ULL << 1) | (1ULL << 2) | (0x7ULL << 5);
    if ((xcr0 & kAvx512State) != kAvx512State) return Isa::Generic;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return Isa::Generic;
    const bool avx512f = ((b >> 16) & 1u) && ((b >> 30) & 1u) && ((b >> 31) & 1u);  // F, BW, VL
    const bool amx = ((d >> 22) & 1u) && ((d >> 24) & 1u);  // AMX-BF16, AMX-TILE
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    const bool avx512bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && ((a1 >> 5) & 1u);
    if (!avx512f || !avx512bf16) return Isa::Generic;  // both x86 kernels use AVX-512 too
    if (amx && request_amx_permission()) {
      constexpr unsigned long long kTileState = (1ULL << 17) | (1ULL << 18);
      if ((read_xcr0() & kTileState) == kTileState) return Isa::Amx;
    }
    return Isa::Avx512Bf16;
#else
    return Isa::Generic;
#endif
  }();
  return isa;
}

/// `detected_isa()` lowered by `EFFATTN_ISA`, read once per process: the path the bf16 kernels
/// use.
inline Isa selected_isa() noexcept {
  static const Isa isa = apply_isa_override(detected_isa(), std::getenv("EFFATTN_ISA"));
  return isa;
}

/// True when the `isa` kernels may run on this machine (isa <= detected_isa()).
inline bool isa_available(Isa isa) noexcept {
  return static_cast<int>(isa) <= static_cast<int>(detected_isa());
}

}  // namespace detail

/// The bf16 kernel path `policy::TiledBf16` uses in this process: `"amx"`, `"avx512bf16"` or
/// `"generic"` (see `core/isa.hpp`: CPUID, what the OS grants, and `EFFATTN_ISA`, which can only
/// force a lower path). Chosen at the first call and fixed afterwards. Thread-safe.
inline const char* active_isa() noexcept {
  return detail::isa_name(detail::selected_isa());
}

}  // namespace effattn
