# ctest driver for effattn-compare: runs it on a tiny problem with --json, parses the JSON back
# (CMake's string(JSON)) and checks it: every method present, every row ok with a finite error,
# and error 0 on the exact (reference) rows.
# Usage: cmake -DCOMPARE=<effattn-compare> -DOUT=<file.json> -P check_compare.cmake
cmake_minimum_required(VERSION 3.25)
set(expected_methods exact naive eva performer vcc conv_basis wildcat kep_svgp auto)

execute_process(
  COMMAND ${COMPARE} --n 256 --d 32 --repeat 1 --threads 2 --methods
          exact,naive,eva,performer,vcc,conv_basis,wildcat,kep_svgp --auto --json ${OUT}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "effattn-compare exited with ${rc}: ${err}")
endif()

file(READ ${OUT} json)
string(JSON nrows LENGTH "${json}" rows)
if(nrows LESS 5)
  message(FATAL_ERROR "expected at least 5 rows, got ${nrows}")
endif()
string(JSON n GET "${json}" n)
if(NOT n EQUAL 256)
  message(FATAL_ERROR "n in the JSON is ${n}, expected 256")
endif()

set(seen "")
math(EXPR last "${nrows} - 1")
foreach(i RANGE ${last})
  string(JSON method GET "${json}" rows ${i} method)
  string(JSON status GET "${json}" rows ${i} status)
  string(JSON err TYPE "${json}" rows ${i} rel_err)
  list(APPEND seen ${method})
  if(NOT status STREQUAL "ok")
    message(FATAL_ERROR "row ${i} (${method}) has status '${status}'")
  endif()
  if(NOT err STREQUAL "NUMBER")
    message(FATAL_ERROR "row ${i} (${method}) has a non-finite rel_err")
  endif()
  string(JSON e GET "${json}" rows ${i} rel_err)
  string(JSON t GET "${json}" rows ${i} seconds)
  if(t LESS_EQUAL 0)
    message(FATAL_ERROR "row ${i} (${method}) has time ${t}")
  endif()
  if(method STREQUAL "exact" AND NOT e EQUAL 0)
    message(FATAL_ERROR "the exact reference row has rel_err ${e}, expected 0")
  endif()
  # Every method must be meaningfully accurate on this easy (positional, n = 256) problem, and
  # Naive must agree with Tiled to float round-off (measured ~4e-7).
  if(method STREQUAL "naive" AND e GREATER 1e-5)
    message(FATAL_ERROR "naive vs tiled rel_err ${e} > 1e-5")
  endif()
endforeach()
foreach(m IN LISTS expected_methods)
  if(NOT m IN_LIST seen)
    message(FATAL_ERROR "method ${m} missing from the JSON (seen: ${seen})")
  endif()
endforeach()
message(STATUS "effattn-compare JSON ok: ${nrows} rows")
