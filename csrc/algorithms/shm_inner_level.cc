// ShmInnerLevel: the shared-memory collectives of local_collectives.h behind InnerLevel.
#include "algorithms/inner_level.h"
#include "algorithms/local_collectives.h"

namespace hetcomm {

void ShmInnerLevel::allreduce(const CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op,
                              double divisor) {
  local::allreduce(ctx, buf, count, dtype, op, divisor);
}
void ShmInnerLevel::reduceScatterv(const CollectiveContext& ctx, char* work, const std::vector<size_t>& counts,
                                   DType dtype, RedOp op, double divisor) {
  local::reduceScatterv(ctx, work, counts, dtype, op, divisor);
}
void ShmInnerLevel::allgatherv(const CollectiveContext& ctx, char* out, const std::vector<size_t>& blockBytes) {
  local::allgatherv(ctx, out, blockBytes);
}
void ShmInnerLevel::broadcast(const CollectiveContext& ctx, char* buf, size_t bytes, int root) {
  local::broadcast(ctx, buf, bytes, root);
}
void ShmInnerLevel::gather(const CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root) {
  local::gather(ctx, in, out, blockBytes, root);
}
void ShmInnerLevel::scatter(const CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root) {
  local::scatter(ctx, in, out, blockBytes, root);
}
void ShmInnerLevel::alltoallv(const CollectiveContext& ctx, const char* in, const std::vector<size_t>& sendOffsets,
                              const std::vector<size_t>& sendBytes, char* out, const std::vector<size_t>& recvOffsets,
                              const std::vector<size_t>& recvBytes) {
  local::alltoallv(ctx, in, sendOffsets, sendBytes, out, recvOffsets, recvBytes);
}
void ShmInnerLevel::barrier(const CollectiveContext& ctx) { local::barrier(ctx); }

}  // namespace hetcomm
