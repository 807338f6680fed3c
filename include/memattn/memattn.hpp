#pragma once
// memattn: attention kernels and attention memories for long sequences.
// Umbrella header; every header it includes also compiles on its own.

/// \namespace memattn
/// Attention kernels and attention memories for long sequences: the whole-sequence
/// kernels, the memories that model memattn::Memory and the algorithms over them, the
/// multi-head layer and snapshots (docs/design.md). memattn::detail is not part of the API.
///
/// \namespace memattn::snapshot
/// The byte level of snapshots (docs/snapshot-format.md): the type codes, the header's
/// constants, and the Writer and Reader a memory's write_snapshot/read_snapshot use.

#include "memattn/version.hpp"
#include "memattn/types.hpp"
#include "memattn/cpu_features.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/execution/executor.hpp"
#include "memattn/feature_maps.hpp"
#include "memattn/positional/rope.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/kernels/causal_softmax.hpp"
#include "memattn/kernels/decode_attention.hpp"
#include "memattn/kernels/linear_attention.hpp"
#include "memattn/kernels/gated_linear_attention.hpp"
#include "memattn/kernels/delta_rule.hpp"
#include "memattn/kernels/rwkv7.hpp"
#include "memattn/memory/concept.hpp"
#include "memattn/memory/kv_cache.hpp"
#include "memattn/memory/latent_kv_cache.hpp"
#include "memattn/memory/sparse_kv_cache.hpp"
#include "memattn/memory/linear_attention_memory.hpp"
#include "memattn/memory/compressor.hpp"
#include "memattn/memory/hybrid_cache.hpp"
#include "memattn/memory/moving_average_cache.hpp"
#include "memattn/memory/sliding_window_cache.hpp"
#include "memattn/memory/gated_memories.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/persistence/snapshot.hpp"
#include "memattn/layer/head_layout.hpp"
#include "memattn/execution/parallel.hpp"
#include "memattn/layer/multi_head_kernels.hpp"
#include "memattn/layer/multi_head_memory.hpp"
#include "memattn/layer/latent_attention.hpp"
#include "memattn/serving/pool_options.hpp"
#include "memattn/serving/paged_kv_cache.hpp"
#include "memattn/serving/paged_latent_kv_cache.hpp"
#include "memattn/serving/state_pool.hpp"
#include "memattn/serving/batched.hpp"
#include "memattn/serving/model_cache.hpp"

// memattn::compiled (CMake target; see memattn/compiled.hpp): the common float
// instantiations come from its library instead of every translation unit.
#ifdef MEMATTN_COMPILED
#include "memattn/compiled.hpp"
#endif
