// Code generation: a function that only asks for cache lines keeps its requests.
//
// GCC counts __builtin_prefetch as free of side effects, so it may infer that a function
// whose only effect is prefetching is `const`, and then delete every call of it (there is
// no result to use). That is how the grouped decode's key and value requests were lost,
// silently (the results do not change, only the speed): the lambda that calls
// prefetch_tile in the AMX logits, a function of its own, was inferred `const`, and so
// were the logit tiles' calls. prefetch_rows ends in an empty volatile asm so that no
// function reaching it is `const`. The probe is that shape at its smallest: a helper of
// its own that only asks for rows, called twice by an exported function, which must
// still call it (check_prefetch.cmake reads the disassembly). Before the fix GCC 12 at
// -O2 compiled the exported function to a lone `ret`.

#include "memattn/detail/tile_product.hpp"

namespace {

[[gnu::noinline]] void ask_rows(const float* p, memattn::Index rows) {
    memattn::detail::prefetch_rows(p, rows, 64, 64);
}

}  // namespace

extern "C" void memattn_probe_prefetch_rows(const float* p, memattn::Index rows) {
    ask_rows(p, rows);
    ask_rows(p + 4096, rows);
}
