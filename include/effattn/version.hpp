/// \file version.hpp
/// \brief Library version macros.
#pragma once

/// Major version.
#define EFFATTN_VERSION_MAJOR 0
/// Minor version.
#define EFFATTN_VERSION_MINOR 1
/// Patch version.
#define EFFATTN_VERSION_PATCH 0
/// Single integer version, 0xMMmmpp (as nanoflann's NANOFLANN_VERSION).
#define EFFATTN_VERSION \
  ((EFFATTN_VERSION_MAJOR << 16) | (EFFATTN_VERSION_MINOR << 8) | EFFATTN_VERSION_PATCH)
