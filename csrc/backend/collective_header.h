#pragma once
// The header of a collective, built in one place so that no collective can leave a field out.
//
// Every rank sends its header ahead of its data on every link, and a receiver that expects
// another header raises instead of misreading the stream. Ranks that called different
// collectives, or the same one with another dtype, op, size or split of their tensors, get an
// error naming the difference, never wrong numbers: the header always carries the kind (set when
// the operation is queued), the dtype, the op, the total bytes, and a fingerprint of the layout
// (every tensor's element count and dtype, in order) together with whatever else shapes the
// schedule (root, ring plan).
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "algorithms/collectives.h"
#include "kernels/dtype.h"
#include "transport/framing.h"

namespace hetcomm {

struct CollectiveShape {
  DType dtype = DType::kUInt8;
  std::optional<RedOp> op;       // for the collectives that reduce
  uint64_t bytes = 0;            // the payload as this rank counts it
  std::vector<uint64_t> layout;  // fingerprinted; see addLayout
  int64_t root = -1;             // rooted collectives
  uint64_t plan = 0;             // fingerprint of the ring plan the schedule follows (0: none)
  std::optional<AllreduceAlgo> algo;

  // Appends each tensor's element count and dtype, in order.
  CollectiveShape& add(const std::vector<at::Tensor>& tensors);
  CollectiveShape& add(const at::Tensor& tensor);
};

CollectiveHeader makeHeader(const CollectiveShape& shape);

}  // namespace hetcomm
