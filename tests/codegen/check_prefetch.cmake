# Reads the disassembly of tests/codegen/prefetch_kept.cpp's object (OBJECT) with
# OBJDUMP: the probe function must do more than return, that is, still call or contain
# its cache-line requests (see the top of prefetch_kept.cpp).
execute_process(COMMAND ${OBJDUMP} -d --no-show-raw-insn ${OBJECT}
                RESULT_VARIABLE rc OUTPUT_VARIABLE listing ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${OBJDUMP} failed on ${OBJECT}: ${err}")
endif()
foreach(probe IN ITEMS memattn_probe_prefetch_rows)
  string(FIND "${listing}" "<${probe}>:" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${probe} is not in ${OBJECT}")
  endif()
  string(LENGTH "<${probe}>:" header)
  math(EXPR at "${at} + ${header}")
  string(SUBSTRING "${listing}" ${at} -1 body)
  string(FIND "${body}" "\n\n" end)
  if(NOT end EQUAL -1)
    string(SUBSTRING "${body}" 0 ${end} body)
  endif()
  if(NOT body MATCHES "(call|jmp|prefetch)")  # the body's own instructions, not its name
    message(FATAL_ERROR "${probe} lost its cache-line requests: the compiler deleted them\n${body}")
  endif()
  string(REGEX MATCHALL "\n" lines "${body}")
  list(LENGTH lines count)
  message(STATUS "${probe}: ${count} instructions, its requests kept")
endforeach()
