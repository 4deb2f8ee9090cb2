#include "test_utils.hpp"
