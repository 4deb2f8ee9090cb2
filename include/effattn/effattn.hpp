/// \file effattn.hpp
/// \brief Umbrella header: every method and the layers below it.
///
/// Header-only C++17 library of exact and approximate softmax attention on Eigen, with an
/// optional compiled mode (the CMake target `effattn::compiled`); see docs/mainpage.md.
///
/// The layers, bottom to top (README "Layout"):
/// - `core/`: what every method shares: matrix aliases and `Info` (`types.hpp`), exceptions and
///   input checks (`errors.hpp`, `checks.hpp`), seeded randomness (`random.hpp`), softmax and
///   log-sum-exp (`softmax.hpp`), the tiled online-softmax kernel (`online_softmax.hpp`), the
///   parallel-or-serial helper (`parallel.hpp`) and the functor concept (`concept.hpp`).
/// - `numerics/`: building blocks some methods build on: FFT backends and batched causal
///   convolution (`fft.hpp`), RP-Cholesky (`rp_cholesky.hpp`), Nystrom weights (`nystrom.hpp`),
///   Lambert W (`lambert_w.hpp`).
/// - the methods, one public header each: `exact.hpp` (ExactAttention), `conv_basis.hpp`
///   (ConvBasisAttention, with `conv_basis_recovery.hpp`), `eva.hpp` (EvaAttention,
///   PerformerAttention), `kep_svgp.hpp` (KepSvgpAttention), `vcc.hpp` (VccAttention, with
///   `vcc_tree.hpp`), `wildcat.hpp` (WildcatAttention, compress_kv).
/// - on top of the methods: `multi_head.hpp` (heads, GQA, variable-length batches, KV caches) and
///   `auto.hpp` (AutoAttention: the fastest method that meets an error target).
/// - `detail/`: private implementation, never included by users directly.
///
/// `workloads.hpp` (synthetic test problems) is not part of the umbrella: include it explicitly.
#pragma once

#include "auto.hpp"
#include "config.hpp"
#include "conv_basis.hpp"
#include "core/checks.hpp"
#include "core/concept.hpp"
#include "core/errors.hpp"
#include "core/online_softmax.hpp"
#include "core/parallel.hpp"
#include "core/random.hpp"
#include "core/softmax.hpp"
#include "core/types.hpp"
#include "eva.hpp"
#include "exact.hpp"
#include "kep_svgp.hpp"
#include "methods.hpp"
#include "multi_head.hpp"
#include "numerics/fft.hpp"
#include "numerics/lambert_w.hpp"
#include "numerics/nystrom.hpp"
#include "numerics/rp_cholesky.hpp"
#include "vcc.hpp"
#include "version.hpp"
#include "wildcat.hpp"
