# Python's reference writer writes a known file; our reader must read every value of it.
execute_process(COMMAND ${PYTHON} ${SCRIPT} ${IN} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "Python could not write ${IN} (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env ACCEL_SAFETENSORS_CROSSCHECK_IN=${IN}
  ${UNIT} "safetensors: read the file written by tests/python/write_safetensors.py" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "reading ${IN} failed (${rc})")
endif()
