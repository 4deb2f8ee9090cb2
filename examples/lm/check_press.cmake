# ctest: every press at keep = 1 through `effattn-lm eval --press` equals exact attention on the
# same spans (|delta| < 1e-3 bits per byte), and the JSON holds the documented fields.
# cmake -DLM=effattn-lm -DLM_DIR=examples/lm -DOUT=out.json -P check_press.cmake
set(spans "${OUT}.spans")
file(WRITE "${spans}" "# three repeated passages of heldout_repeats.txt\n1140 241\n2455 400\n6000 1\n")
execute_process(
  COMMAND "${LM}" eval --model decoder --method exact --context 768 --no-progress
          --text "${LM_DIR}/data/heldout_repeats.txt" --spans "${spans}"
          --press drop,streaming,uniform,knorm,snapkv,observed,wildcat,vcc --keep 1
          --bootstrap 200 --json "${OUT}"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "effattn-lm eval --press failed (${rc})")
endif()
file(READ "${OUT}" json)
foreach(field bits_per_byte span_bits_per_byte delta ci95 exact presses)
  string(JSON ignored ERROR_VARIABLE err GET "${json}" ${field})
  if(err)
    message(FATAL_ERROR "the JSON has no '${field}': ${err}")
  endif()
endforeach()
string(JSON n LENGTH "${json}" presses)
if(NOT n EQUAL 8)
  message(FATAL_ERROR "expected 8 presses, got ${n}")
endif()
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  string(JSON press GET "${json}" presses ${i} press)
  string(JSON delta GET "${json}" presses ${i} delta)
  # |delta| < 1e-3 without floating-point arithmetic in CMake: the exponent form of a small
  # number, or a plain decimal below 0.001.
  if(NOT delta MATCHES "^-?(0(\\.0*)?|[0-9.]+e-(0*[4-9]|[1-9][0-9]+)|0\\.000[0-9]*)$")
    message(FATAL_ERROR "press ${press} at keep 1: delta ${delta} bits per byte, expected < 1e-3")
  endif()
  message(STATUS "press ${press} at keep 1: delta ${delta}")
endforeach()
