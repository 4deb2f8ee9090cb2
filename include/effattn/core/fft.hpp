/// \file core/fft.hpp
/// \brief Kept for the public API contract: the code lives in `effattn/numerics/fft.hpp`.
///
/// `core/` holds what every method shares; the numerical building blocks (FFT, RP-Cholesky,
/// Nystrom, Lambert W) form the `numerics/` layer above it. Include `<effattn/numerics/fft.hpp>`
/// in new code; this header only forwards.
#pragma once

#include "../numerics/fft.hpp"
