#pragma once
// memattn: attention kernels and attention memories for long sequences.
// Umbrella header; every header it includes also compiles on its own.

#include "memattn/version.hpp"
#include "memattn/types.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/feature_maps.hpp"
#include "memattn/kernels/causal_softmax.hpp"
#include "memattn/kernels/linear_attention.hpp"
#include "memattn/memory/concept.hpp"
#include "memattn/memory/kv_cache.hpp"
#include "memattn/memory/linear_attention_memory.hpp"
#include "memattn/memory/compressor.hpp"
#include "memattn/memory/hybrid_cache.hpp"
#include "memattn/memory/moving_average_cache.hpp"
#include "memattn/memory/sliding_window_cache.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/persistence/snapshot.hpp"
#include "memattn/layer/head_layout.hpp"
#include "memattn/layer/parallel.hpp"
#include "memattn/layer/multi_head_kernels.hpp"
#include "memattn/layer/multi_head_memory.hpp"
