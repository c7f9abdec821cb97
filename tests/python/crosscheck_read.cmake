# C++ writes a safetensors file; Python's reference reader must print exactly the expected description.
execute_process(COMMAND ${CMAKE_COMMAND} -E env ACCEL_SAFETENSORS_CROSSCHECK_OUT=${OUT}
  ${UNIT} "safetensors: write the file read by tests/python/read_safetensors.py" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "writing ${OUT} failed (${rc})")
endif()
execute_process(COMMAND ${PYTHON} ${SCRIPT} ${OUT} OUTPUT_VARIABLE got RESULT_VARIABLE rc)
file(READ ${EXPECTED} want)
if(NOT rc EQUAL 0 OR NOT got STREQUAL want)
  message(FATAL_ERROR "Python read ${OUT} as:\n${got}\nexpected:\n${want}")
endif()
