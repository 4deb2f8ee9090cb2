/// \file core/nystrom.hpp
/// \brief Kept for the public API contract: the code lives in `effattn/numerics/nystrom.hpp`.
///
/// `core/` holds what every method shares; the numerical building blocks (FFT, RP-Cholesky,
/// Nystrom, Lambert W) form the `numerics/` layer above it. Include
/// `<effattn/numerics/nystrom.hpp>` in new code; this header only forwards.
#pragma once

#include "../numerics/nystrom.hpp"
