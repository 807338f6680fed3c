#pragma once
// Past one machine: sequence parallelism over MPI. The one memattn header that includes
// <mpi.h>; link the CMake target memattn::mpi (built when CMake finds MPI).
//
// Each of P ranks of a communicator holds a shard of one sequence: its queries, keys and
// values (rows of Q, K, V), its outputs. Two algebraic facts make the split exact:
//   - softmax partials over disjoint key sets merge through (max, sum, acc), i.e. through
//     each block's normalised output and log-sum-exp (SoftmaxState);
//   - linear-attention states compose associatively: the state after shards a then b is
//     (γ^{n_b} μ_a + μ_b, γ^{n_b} ν_a + ν_b), with γ^{n_a + n_b} for the pair.
//
// distributed_causal_softmax_attention — ring attention (Liu et al. 2023, "Ring Attention
//   with Blockwise Transformers"). The K/V shards travel around the ring of ranks, each
//   hop a non-blocking send and receive posted before the rank works on the block it
//   holds, so the transfer overlaps the tile work. Every (query chunk, key chunk) pair
//   wholly in the causal future, or wholly before every query's window (and holding no
//   sink), is skipped. The softcap and ALiBi apply per block (a block's positions keep
//   the distances); each head's sink logit joins once, after the last block (a block of
//   value 0 and log-sum-exp σ). Non-causal calls (options.causal = false) fold every
//   block both ways, skipping only blocks outside every query's window; tree calls
//   are refused. Layouts:
//     contiguous  rank r holds tokens [o_r, o_r + n_r): rank P−1 does the most work (its
//                 queries see every earlier shard), rank 0 the least;
//     zigzag      the sequence is cut into 2P chunks and rank r holds chunks r and
//                 2P−1−r (its first ⌈n_r/2⌉ rows, then the rest), so every rank gets one
//                 early and one late chunk and the causal triangle splits evenly.
//   Communication: every rank sends every K/V block except the last it receives once
//   around the ring, (P−1)·n·(d+dv) scalars per rank for shards of n tokens; the
//   minimum for exact attention with the causal rule, sending each block only to the
//   ranks whose queries see it, is (P−1−r)·n·(d+dv) for rank r (on average half).
//
// distributed_chunked_linear_attention — sequence-parallel linear attention (the idea of
//   LASP, Sun et al. 2024, "Linear Attention Sequence Parallelism"): every rank but the
//   last folds its shard into a summary (μ_r, ν_r, γ^{n_r}) from a zero state (one GEMM
//   per chunk, the third of the chunked form's three); an exclusive scan with the
//   composition above (MPI_Exscan with a user operation, log₂P rounds) gives each rank
//   the state before its first token; each rank then runs the chunked form on its shard
//   from that state. The outputs equal the single-process chunked form to rounding.
//   Communication: one summary of d'·dv + d' + 1 doubles per rank and round of the scan,
//   and one broadcast of the final state when a rank asks for it: independent of n.
//
// distributed_chunked_gated_linear_attention — the same for gated linear attention: a
//   shard maps the state before it to diag(e^{Λ}) S + S_shard; every rank runs its shard
//   at once and the later ones add their carried state's part to their rows.
//
// distributed_chunked_delta_rule_attention, distributed_chunked_kda_attention — the delta
//   rule (ungated, gated, KDA): a shard maps the state before it to P S + B with P a
//   dense d × d matrix. A later rank runs its shard once with d extra value columns
//   (zero values, the identity as their state), which give P and each row's q_t P_t;
//   an exclusive scan of the (P, B) gives each rank its starting state, whose part the
//   later ranks add to their rows. About two passes' work per token on a later rank.
//
// ShardedKVCache — a KVCache whose pairs are spread over the ranks (token t on rank
//   t mod P): every rank calls update with the same pair and only its owner stores it;
//   attend computes each rank's partial (max, sum, acc) over its pairs and merges the P
//   partials in rank order after one MPI_Allgather, so every rank gets the same bits, on
//   every run, and a step reads P machines' memory at once.
//
// Every function is collective over its communicator: all ranks call it, in the same
// order. Shapes and options are checked on every rank first and compared across ranks:
// if one rank has a bad argument, or the ranks disagree (d, dv, options), every rank
// throws the same std::invalid_argument, so none is left waiting in a collective. A rank
// that dies is out of scope: MPI itself then aborts or hangs the job, and memattn adds
// no fault tolerance of its own. MPI errors are MPI's (by default they abort the job).
// Threads: the calls go to MPI from the calling thread; attend from several threads at
// once needs MPI_THREAD_MULTIPLE and separate communicators.

//
// One header per algorithm, over distributed/collectives.hpp (what they share); this one
// includes them all:
//   ring_attention.hpp     distributed_causal_softmax_attention, RingLayout
//   linear.hpp             distributed_chunked_linear_attention
//   gated.hpp              distributed_chunked_gated_linear_attention
//   delta_rule.hpp         distributed_chunked_delta_rule_attention (and its gated form),
//                          distributed_chunked_kda_attention
//   sharded_kv_cache.hpp   ShardedKVCache

#include "memattn/distributed/collectives.hpp"
#include "memattn/distributed/delta_rule.hpp"
#include "memattn/distributed/gated.hpp"
#include "memattn/distributed/linear.hpp"
#include "memattn/distributed/ring_attention.hpp"
#include "memattn/distributed/sharded_kv_cache.hpp"
