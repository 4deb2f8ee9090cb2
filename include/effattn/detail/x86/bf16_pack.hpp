/// \file bf16_pack.hpp
/// \brief bf16 rounding and the packed panels of `policy::TiledBf16`: Q, K and V converted to
/// bf16 once per call, in the layouts the AMX and AVX512-BF16 kernels read, and the rounding of
/// a probability tile P into the VNNI operand of the P V product.
///
/// bf16 is the upper half of an IEEE float: 8 exponent bits, 8 significand bits (7 stored).
/// Rounding is to nearest, ties to even, as Eigen::bfloat16 and `vcvtneps2bf16` do, so a value's
/// relative rounding error is at most 2^-9.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../core/isa.hpp"
#include "../../core/parallel.hpp"
#include "../../core/types.hpp"

namespace effattn {
namespace detail {

/// A 64-byte aligned buffer of bf16 bit patterns.
using Bf16Buffer = Eigen::Matrix<std::uint16_t, Eigen::Dynamic, 1>;

/// `x` rounded to bf16 (nearest, ties to even), as its 16 bits. x must not be NaN.
inline std::uint16_t bf16_bits(float x) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

/// The float whose upper half is `b` (exact).
inline float bf16_to_float(std::uint16_t b) noexcept {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

/// bf16 bits of `scale * x` for a float input.
inline std::uint16_t to_bf16(float x, float scale) noexcept {
  return bf16_bits(x * scale);
}

/// bf16 bits of `scale * x` for a bf16 input: the stored bits when scale is 1, otherwise the
/// product rounded again.
inline std::uint16_t to_bf16(Eigen::bfloat16 x, float scale) noexcept {
  return scale == 1.0f ? x.value : bf16_bits(static_cast<float>(x) * scale);
}

/// `x` rounded to bf16 and widened back to float.
template <typename In>
float rounded_float(In x, float scale) noexcept {
  return bf16_to_float(to_bf16(x, scale));
}

/// dst[i] = bf16 bits of scale * src[i] for i < count (contiguous).
template <typename In>
void convert_bf16(const In* src, Index count, float scale, std::uint16_t* dst) noexcept {
  for (Index i = 0; i < count; ++i) dst[i] = to_bf16(src[i], scale);
}

#if EFFATTN_BF16_X86
/// x >> 16 and x << 16 per 32-bit lane. The zero-masked forms with an all-ones mask are the same
/// instruction; the plain `_mm512_srli_epi32` / `_mm512_slli_epi32` / `_mm512_cvtepu16_epi32` of
/// GCC 12 pass `_mm512_undefined_epi32()` through, which -Wall reports as maybe-uninitialized in
/// every user translation unit that inlines them (GCC PR 105593, fixed in GCC 13).
EFFATTN_TARGET_AVX512 inline __m512i srl16(__m512i x) noexcept {
  return _mm512_maskz_srli_epi32(__mmask16(0xFFFF), x, 16);
}
EFFATTN_TARGET_AVX512 inline __m512i sll16(__m512i x) noexcept {
  return _mm512_maskz_slli_epi32(__mmask16(0xFFFF), x, 16);
}

/// The float bit patterns u with the bf16 rounding (nearest, ties to even) added: the high 16
/// bits of each lane are the rounded bf16 (the low 16 bits are garbage). No NaN inputs (a NaN
/// may round to an infinity, which the callers' finiteness checks treat alike).
EFFATTN_TARGET_AVX512 inline __m512i bf16_round_bits(__m512i u) noexcept {
  return _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                              _mm512_and_si512(srl16(u), _mm512_set1_epi32(1))));
}

/// x rounded to bf16 (nearest even) and widened back to fp32, 16 lanes.
EFFATTN_TARGET_AVX512 inline __m512 bf16_round16(__m512 x) noexcept {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_round_bits(_mm512_castps_si512(x)),
                                              _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

/// `convert_bf16` for float with AVX512F, 16 values per step (masked tail). Used only by the x86
/// kernels' packing, which runs after `detected_isa()` found AVX-512.
EFFATTN_TARGET_AVX512 inline void convert_bf16(const float* src, Index count, float scale,
                                               std::uint16_t* dst) noexcept {
  const __m512 sc = _mm512_set1_ps(scale);
  for (Index i = 0; i < count; i += 16) {
    const Index left = count - i;
    const __mmask16 k = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, src + i), sc));
    _mm512_mask_cvtepi32_storeu_epi16(dst + i, k, srl16(bf16_round_bits(u)));
  }
}
#endif

/// Rounds up to a multiple of `to`.
constexpr Index round_up(Index x, Index to) noexcept {
  return (x + to - 1) / to * to;
}

/// Q, K and V of one call in bf16, in the layouts of the AMX and AVX512-BF16 kernels. Rows and
/// the head widths are padded with zeros: npad and mpad to multiples of 32 tokens, dpad and
/// dvpad to multiples of 32 columns. O((n + m) d) memory, 2 bytes per value.
struct Bf16Panels {
  Index n = 0, m = 0, d = 0, dv = 0, npad = 0, mpad = 0, dpad = 0, dvpad = 0;
  /// scale Q in VNNI groups: [npad / 16][dpad / 2][16 queries][2 adjacent columns]. One group's
  /// 32-column slice is the 16 x 64-byte B operand of the score tile (and the broadcast-free
  /// operand of the AVX512 kernel).
  Bf16Buffer q;
  /// K row-major: [mpad][dpad]. 16 keys x 32 columns is the A operand of the score tile.
  Bf16Buffer k;
  /// V in 32-key chunks, transposed: [mpad / 32][dvpad][32 keys]. 16 value columns x 32 keys
  /// is the A operand of the P V tile; two adjacent keys of one column form a VNNI pair.
  Bf16Buffer v;

  /// Start of query group g (16 rows).
  const std::uint16_t* q_group(Index g) const { return q.data() + g * (dpad / 2) * 32; }
  /// Start of key j's row.
  const std::uint16_t* k_row(Index j) const { return k.data() + j * dpad; }
  /// Start of the 32-key chunk that holds key j (j a multiple of 32).
  const std::uint16_t* v_chunk(Index j) const { return v.data() + (j / 32) * dvpad * 32; }
};

/// The generic path's operands: the bf16-rounded scale Q (n x d), K^T (d x m) and V (m x dv)
/// widened back to float, so Eigen's float GEMM multiplies exactly the values the bf16 kernels
/// multiply (and accumulates in fp32 as they do). O((n + m) d) floats.
struct Bf16RoundedFloats {
  Matrix<float> q, kt, v;
};

/// q = bf16(scale Q), kt = bf16(K)^T, v = bf16(V), each widened back to float (In = float or
/// Eigen::bfloat16). `QOut` is column- or row-major (WildCat's portable path multiplies a
/// row-major q through RP-Cholesky's product expression); q is written along its storage order.
/// O((n + m) d).
template <typename In, typename QOut>
void round_to_bf16_floats(const Eigen::Ref<const Matrix<In>>& Q,
                          const Eigen::Ref<const Matrix<In>>& K,
                          const Eigen::Ref<const Matrix<In>>& V, float scale, QOut& q,
                          Matrix<float>& kt, Matrix<float>& v) {
  q.resize(Q.rows(), Q.cols());
  kt.resize(K.cols(), K.rows());
  v.resize(V.rows(), V.cols());
  if constexpr (QOut::IsRowMajor) {
    for (Index i = 0; i < Q.rows(); ++i)
      for (Index c = 0; c < Q.cols(); ++c) q(i, c) = rounded_float(Q(i, c), scale);
  } else {
    for (Index c = 0; c < Q.cols(); ++c)
      for (Index i = 0; i < Q.rows(); ++i) q(i, c) = rounded_float(Q(i, c), scale);
  }
  for (Index j = 0; j < K.rows(); ++j)
    for (Index c = 0; c < K.cols(); ++c) kt(c, j) = rounded_float(K(j, c), 1.0f);
  for (Index c = 0; c < V.cols(); ++c)
    for (Index j = 0; j < V.rows(); ++j) v(j, c) = rounded_float(V(j, c), 1.0f);
}

/// Fills `Bf16RoundedFloats` from Q, K, V (In = float or Eigen::bfloat16). O((n + m) d).
template <typename In>
void round_to_bf16_floats(const Eigen::Ref<const Matrix<In>>& Q,
                          const Eigen::Ref<const Matrix<In>>& K,
                          const Eigen::Ref<const Matrix<In>>& V, float scale,
                          Bf16RoundedFloats& r) {
  round_to_bf16_floats<In>(Q, K, V, scale, r.q, r.kt, r.v);
}

/// dst[i] = src[i] rounded to bf16 and widened back to float, for i < count (contiguous).
template <typename In>
void round_floats(const In* src, Index count, float* dst) noexcept {
  for (Index i = 0; i < count; ++i) dst[i] = rounded_float(src[i], 1.0f);
}

/// Rounds the probabilities P (the first `rows` x `cols` of a column-major tile with leading
/// dimension `ld`) to bf16 in place (generic path).
inline void round_tile_to_bf16(float* s, Index ld, Index rows, Index cols) noexcept {
  for (Index c = 0; c < cols; ++c)
    for (Index i = 0; i < rows; ++i) s[c * ld + i] = bf16_to_float(bf16_bits(s[c * ld + i]));
}

#if EFFATTN_BF16_X86
/// 16 VNNI pairs from two fp32 vectors: pair i = (bf16(a_i), bf16(b_i)) in one 32-bit lane
/// (a in the low half), both rounded to nearest even. No NaN inputs.
EFFATTN_TARGET_AVX512 inline __m512i bf16_vnni_pairs(__m512 a, __m512 b) noexcept {
  return _mm512_or_si512(srl16(bf16_round_bits(_mm512_castps_si512(a))),
                         _mm512_castps_si512(bf16_round16(b)));
}

/// Rounds the probabilities P of a column-major fp32 tile (leading dimension `ld`, `rows` a
/// multiple of 16, `cols_pad` a multiple of 32) to bf16 in VNNI pairs: pv[(p * ld + i) * 2 + e]
/// = P(i, 2p + e), with the columns >= `cols` set to 0 (keys outside the tile). This is the B
/// operand of the P V product of both x86 kernels. O(rows cols_pad); needs AVX512F (and only
/// runs after `detected_isa()` said so). P holds no NaN.
EFFATTN_TARGET_AVX512 inline void pack_p_vnni(const float* s, Index ld, Index rows, Index cols,
                                              Index cols_pad, std::uint16_t* pv) noexcept {
  for (Index c = 0; c < cols_pad; c += 2) {
    const bool have0 = c < cols, have1 = c + 1 < cols;
    for (Index i = 0; i < rows; i += 16) {
      const __m512 a = have0 ? _mm512_loadu_ps(s + c * ld + i) : _mm512_setzero_ps();
      const __m512 b = have1 ? _mm512_loadu_ps(s + (c + 1) * ld + i) : _mm512_setzero_ps();
      const __m512i packed = bf16_vnni_pairs(a, b);
      _mm512_storeu_si512(pv + ((c / 2) * ld + i) * 2, packed);
    }
  }
}

/// 16 values of a column as fp32 (masked: `count` < 16 loads zeros beyond), float or bf16.
EFFATTN_TARGET_AVX512 inline __m512 load16_fp32(const float* p, Index count) noexcept {
  return _mm512_maskz_loadu_ps(count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1u), p);
}
EFFATTN_TARGET_AVX512 inline __m512 load16_fp32(const Eigen::bfloat16* p, Index count) noexcept {
  const __m256i h =
      _mm256_maskz_loadu_epi16(count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1u), p);
  return _mm512_castsi512_ps(sll16(_mm512_maskz_cvtepu16_epi32(__mmask16(0xFFFF), h)));
}

/// Query group g (16 rows from `Q`, `count` of them valid, leading dimension `ldq`) of scale Q in
/// VNNI pairs: dst[p][i][e] = bf16(scale Q(16 g + i, 2 p + e)), zero outside Q.
template <typename In>
EFFATTN_TARGET_AVX512 void pack_query_group(const In* Q, Index ldq, Index count, Index d,
                                            Index dpad, float scale, std::uint16_t* dst) noexcept {
  const __m512 sc = _mm512_set1_ps(scale), zero = _mm512_setzero_ps();
  for (Index pr = 0; pr < dpad / 2; ++pr) {
    const Index c = 2 * pr;
    const __m512 a = c < d ? _mm512_mul_ps(load16_fp32(Q + c * ldq, count), sc) : zero;
    const __m512 b = c + 1 < d ? _mm512_mul_ps(load16_fp32(Q + (c + 1) * ldq, count), sc) : zero;
    _mm512_storeu_si512(dst + pr * 32, bf16_vnni_pairs(a, b));
  }
}

/// 16 keys from `K` (`count` valid, leading dimension `ldk`) rounded to bf16 into the row-major
/// panel rows `dst` (leading dimension dpad): each VNNI pair of two columns is one 32-bit word of
/// a key row, written by a scatter.
template <typename In>
EFFATTN_TARGET_AVX512 void pack_key_rows(const In* K, Index ldk, Index count, Index d, Index dpad,
                                         std::uint16_t* dst) noexcept {
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 k = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1u);
  const __m512i rows =
      _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                         _mm512_set1_epi32(static_cast<int>(dpad / 2)));
  for (Index pr = 0; pr < d / 2 + (d & 1); ++pr) {
    const Index c = 2 * pr;
    const __m512 a = load16_fp32(K + c * ldk, count);
    const __m512 b = c + 1 < d ? load16_fp32(K + (c + 1) * ldk, count) : zero;
    _mm512_mask_i32scatter_epi32(dst + c, k, rows, bf16_vnni_pairs(a, b), 4);
  }
}

/// Converts Q (scaled by `scale`), K and V to `Bf16Panels`, once per call. In is float or
/// Eigen::bfloat16. O((n + m) d) vector code, in parallel over 32-row chunks (exact, so
/// thread-independent). x86 only (the panels feed the AMX and AVX512-BF16 kernels).
template <typename In>
void pack_bf16_panels(const Eigen::Ref<const Matrix<In>>& Q, const Eigen::Ref<const Matrix<In>>& K,
                      const Eigen::Ref<const Matrix<In>>& V, float scale, Bf16Panels& p) {
  p.n = Q.rows();
  p.m = K.rows();
  p.d = Q.cols();
  p.dv = V.cols();
  p.npad = round_up(p.n, 32);
  p.mpad = round_up(p.m, 32);
  p.dpad = round_up(p.d, 32);
  p.dvpad = round_up(p.dv, 32);
  p.q.setZero(p.npad * p.dpad);
  p.k.setZero(p.mpad * p.dpad);
  p.v.setZero(p.mpad * p.dvpad);
  const Index q_tasks = p.npad / 32, k_tasks = p.mpad / 32;
  const bool worth = (p.n + p.m) * (p.d + p.dv) >= (Index(1) << 16);
  parallel_for_if(worth, q_tasks + k_tasks, [&](Index t) {
    if (t < q_tasks) {
      for (Index g = 2 * t; g < 2 * t + 2; ++g) {
        const Index rows = std::max<Index>(0, std::min<Index>(16, p.n - g * 16));
        if (rows > 0)
          pack_query_group<In>(Q.data() + g * 16, Q.outerStride(), rows, p.d, p.dpad, scale,
                               p.q.data() + g * (p.dpad / 2) * 32);
      }
      return;
    }
    const Index j0 = (t - q_tasks) * 32, rows = std::min<Index>(32, p.m - j0);
    for (Index h = 0; h < rows; h += 16)
      pack_key_rows<In>(K.data() + j0 + h, K.outerStride(), std::min<Index>(16, rows - h), p.d,
                        p.dpad, p.k.data() + (j0 + h) * p.dpad);
    std::uint16_t* vd = p.v.data() + (j0 / 32) * p.dvpad * 32;
    for (Index c = 0; c < p.dv; ++c)
      convert_bf16(V.data() + c * V.outerStride() + j0, rows, 1.0f, vd + c * 32);
  });
}

#endif

}  // namespace detail
}  // namespace effattn
