# FindFFTW3
# ---------
# Finds FFTW 3 in double (libfftw3) and single (libfftw3f) precision. Debian's libfftw3-dev ships
# only pkg-config files, no CMake package, so effattn carries (and installs) this module.
#
# Imported targets:
#   FFTW3::fftw3   double precision
#   FFTW3::fftw3f  single precision
#
# Result variables: FFTW3_FOUND, FFTW3_VERSION, FFTW3_INCLUDE_DIR, FFTW3_LIBRARY, FFTW3F_LIBRARY.
# pkg-config is used for hints when available; plain find_path/find_library work without it.

find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(PC_FFTW3 QUIET fftw3)
  pkg_check_modules(PC_FFTW3F QUIET fftw3f)
endif()

find_path(FFTW3_INCLUDE_DIR NAMES fftw3.h HINTS ${PC_FFTW3_INCLUDE_DIRS} ${PC_FFTW3F_INCLUDE_DIRS})
find_library(FFTW3_LIBRARY NAMES fftw3 HINTS ${PC_FFTW3_LIBRARY_DIRS})
find_library(FFTW3F_LIBRARY NAMES fftw3f HINTS ${PC_FFTW3F_LIBRARY_DIRS})
if(PC_FFTW3_VERSION)
  set(FFTW3_VERSION "${PC_FFTW3_VERSION}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(
  FFTW3
  REQUIRED_VARS FFTW3_LIBRARY FFTW3F_LIBRARY FFTW3_INCLUDE_DIR
  VERSION_VAR FFTW3_VERSION)

if(FFTW3_FOUND)
  if(NOT TARGET FFTW3::fftw3)
    add_library(FFTW3::fftw3 UNKNOWN IMPORTED)
    set_target_properties(FFTW3::fftw3 PROPERTIES IMPORTED_LOCATION "${FFTW3_LIBRARY}"
                                                  INTERFACE_INCLUDE_DIRECTORIES "${FFTW3_INCLUDE_DIR}")
  endif()
  if(NOT TARGET FFTW3::fftw3f)
    add_library(FFTW3::fftw3f UNKNOWN IMPORTED)
    set_target_properties(FFTW3::fftw3f PROPERTIES IMPORTED_LOCATION "${FFTW3F_LIBRARY}"
                                                   INTERFACE_INCLUDE_DIRECTORIES "${FFTW3_INCLUDE_DIR}")
  endif()
endif()

mark_as_advanced(FFTW3_INCLUDE_DIR FFTW3_LIBRARY FFTW3F_LIBRARY)
