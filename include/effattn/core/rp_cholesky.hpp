/// \file core/rp_cholesky.hpp
/// \brief Kept for the public API contract: the code lives in `effattn/numerics/rp_cholesky.hpp`.
///
/// `core/` holds what every method shares; the numerical building blocks (FFT, RP-Cholesky,
/// Nystrom, Lambert W) form the `numerics/` layer above it. Include
/// `<effattn/numerics/rp_cholesky.hpp>` in new code; this header only forwards.
#pragma once

#include "../numerics/rp_cholesky.hpp"
