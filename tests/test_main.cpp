// The Catch2 main, compiled once and linked into every test executable.
#define CATCH_CONFIG_MAIN
#include "test_utils.hpp"
