#pragma once
// SoftmaxOptions: what every softmax entry point takes beside its tensors (the kernels,
// the softmax memories, the paged pool): the scale of q·k, a sliding window and its sink
// tokens (docs/design.md, "Causal softmax attention"). A header of its own, so that a
// caller who only names the options does not compile the tiled kernel.

#include "memattn/types.hpp"

namespace memattn {

/// Options of causal_softmax_attention (docs/design.md).
struct SoftmaxOptions {
    double scale = 0;  ///< multiplies q·k before the softmax; 0 means 1/sqrt(d)
    Index window = 0;  ///< each query sees its last `window` keys, itself included; 0: no limit
    Index sinks = 0;   ///< the first `sinks` tokens stay visible to every later query (StreamingLLM)
};

}  // namespace memattn
