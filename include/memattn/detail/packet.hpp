#pragma once
// Eigen's SIMD packet of a scalar, for the hand-blocked loops of the kernels. The same
// loops instantiated with the scalar itself as the "packet" handle leftover lanes,
// since Eigen's generic packet functions (pset1, pmadd, pexp, ...) accept scalars.

#include "memattn/types.hpp"

#include <Eigen/Core>

namespace memattn::detail {

template <class T>
using Packet = typename Eigen::internal::packet_traits<T>::type;

/// Lanes in one SIMD packet of T (1 when Eigen does not vectorise T).
template <class T>
inline constexpr Index packet_lanes = Eigen::internal::unpacket_traits<Packet<T>>::size;

}  // namespace memattn::detail
