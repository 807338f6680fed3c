# Builds one target that must not compile and checks that its first error is memattn's
# one-line rule (EXPECT), so a user does not have to dig through template noise for it.
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BINARY_DIR} --target ${TARGET}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(log "${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but it must not")
endif()
string(REGEX MATCH "error: [^\n]*" first_error "${log}")
if(NOT first_error MATCHES "${EXPECT}")
  message(FATAL_ERROR "${TARGET}: the first error is\n  ${first_error}\nexpected it to say: ${EXPECT}\n${log}")
endif()
message(STATUS "${TARGET}: ${first_error}")
