/// \file effattn.hpp
/// \brief Umbrella header: every method, MultiHead, AutoAttention and the layers below them.
///
/// Header-only C++17 library of exact and approximate softmax attention on Eigen, with an
/// optional compiled mode (the CMake target `effattn::compiled`). The layers and what each
/// header holds are described in docs/architecture.md.
///
/// Not included here: `workloads.hpp` (synthetic test problems), `kv_press.hpp` (KV-cache
/// presses) and `distributed/mpi.hpp` (MPI); include them explicitly. A translation unit that
/// uses one method compiles faster with that method's header alone.
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
