#pragma once
// MEMATTN_DASSERT: invariant checks inside hot loops, compiled out under NDEBUG.
// Public entry points check their input with detail::require instead, always.

#include <cstdio>
#include <cstdlib>

#ifdef NDEBUG
#define MEMATTN_DASSERT(cond) static_cast<void>(0)
#else
#define MEMATTN_DASSERT(cond)                                                                             \
    ((cond) ? static_cast<void>(0)                                                                        \
            : (std::fprintf(stderr, "%s:%d: memattn internal check failed: %s\n", __FILE__, __LINE__, #cond), \
               std::abort()))
#endif
