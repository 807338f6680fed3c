// Must not compile: a layer keeps a reference to its executor, so a temporary one would
// be gone before the calls that use it. The build's first error names the rule.
#include <memattn/memattn.hpp>

void run_on_a_temporary() {
    memattn::MultiHead<memattn::KVCache<float>> layer({2, 1, 4}, [](memattn::Index) { return memattn::KVCache<float>(4, 4); });
    layer.set_executor(memattn::SerialExecutor{});
}
