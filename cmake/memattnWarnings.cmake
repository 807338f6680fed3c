# Warnings are errors for memattn's own targets (tests, benchmarks, examples), never
# for a consumer's: the library target itself carries no compile options.
function(memattn_strict_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Werror)
endfunction()
