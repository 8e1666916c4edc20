#include "backend/collective_header.h"

namespace hetcomm {
namespace {

// Header value of `op` for the collectives that do not reduce: no RedOp has it.
constexpr uint8_t kNoOp = 0xff;

uint64_t fnv1a(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

CollectiveShape& CollectiveShape::add(const at::Tensor& tensor) {
  layout.push_back(static_cast<uint64_t>(tensor.numel()));
  layout.push_back(static_cast<uint64_t>(tensor.scalar_type()));
  return *this;
}

CollectiveShape& CollectiveShape::add(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) add(t);
  return *this;
}

CollectiveHeader makeHeader(const CollectiveShape& shape) {
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(shape.dtype);
  h.redop = shape.op ? static_cast<uint8_t>(*shape.op) : kNoOp;
  h.bytes = shape.bytes;
  h.algo = shape.algo ? static_cast<uint8_t>(*shape.algo) : 0;
  uint64_t fp = 1469598103934665603ull;
  fp = fnv1a(fp, shape.layout.size());
  for (uint64_t v : shape.layout) fp = fnv1a(fp, v);
  fp = fnv1a(fp, static_cast<uint64_t>(shape.root));
  fp = fnv1a(fp, shape.plan);
  h.aux = fp;
  return h;
}

}  // namespace hetcomm
