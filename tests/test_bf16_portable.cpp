// test_bf16 compiled for plain x86-64 (no -march, see tests/CMakeLists.txt): the bf16 kernels
// must work from their function target attributes alone, as users build without -march flags.
// (Without this build a dropped tile-configuration store went unnoticed: -march=native inlined
// differently and hid it.)
#include "test_bf16.cpp"
