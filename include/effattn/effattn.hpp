/// \file effattn.hpp
/// \brief Umbrella header: every public effattn header.
///
/// \mainpage effattn
/// Header-only C++17 library of exact and approximate softmax attention on Eigen.
/// Public headers: `exact.hpp` (ExactAttention), `conv_basis.hpp` (ConvBasisAttention),
/// `eva.hpp` (EvaAttention, PerformerAttention), `kep_svgp.hpp` (KepSvgpAttention),
/// `vcc.hpp` (VccAttention, VccTree), `wildcat.hpp` (WildcatAttention, compress_kv),
/// `workloads.hpp` (synthetic problems) and the shared utilities under `core/`. See README.md for
/// the method table and examples.
#pragma once

#include "config.hpp"
#include "conv_basis.hpp"
#include "core/checks.hpp"
#include "core/errors.hpp"
#include "core/fft.hpp"
#include "core/lambert_w.hpp"
#include "core/nystrom.hpp"
#include "core/parallel.hpp"
#include "core/random.hpp"
#include "core/rp_cholesky.hpp"
#include "core/softmax.hpp"
#include "core/types.hpp"
#include "eva.hpp"
#include "exact.hpp"
#include "kep_svgp.hpp"
#include "vcc.hpp"
#include "version.hpp"
#include "wildcat.hpp"
#include "workloads.hpp"
