#pragma once
// Collectives among the ranks of one host, through their shared-memory channel (ctx.local; see
// transport/shm/channel.h for the segment and the chunk protocol).
//
// Every collective moves its data in chunks no larger than a slot, so shared memory does not grow
// with the message, and each chunk goes through the same three steps on every local rank:
//
//   post     copy this rank's part of the chunk into its slot, with a header describing the call;
//   middle   (reductions) reduce this rank's slice of the chunk straight from every rank's slot
//            into its own slot (reduceMany: one pass, fp16/bf16 accumulated in fp32);
//   consume  copy what this rank needs out of the slots into its buffers.
//
// Between the steps a rank waits for the others (ShmChannel::waitFor), and after `post` it
// compares every rank's header with its own: ranks that called different collectives, or the
// same one with other sizes, dtypes or ops, fail on every local rank with a message naming the
// difference. A rank that does not arrive fails the others at the deadline, naming it; a rank
// whose process dies is noticed within 100 ms (its connections close); a rank that gives up
// aborts the channel and the others fail at once. Results are the same bits on every rank: each
// element is reduced once, by one rank, in local-rank order.
//
// Memory traffic per rank and byte of an allreduce: the input is read once and the output
// written once (the two that must touch main memory); the slot writes, the reduction's reads and
// the copy-out's reads stay within a chunk that was just written, in cache when the slots are
// small enough (HETCOMM_SHM_SLOT_BYTES).
//
// With ctx.device set the buffers are device memory: copies in and out go through the DeviceOps
// queue (for CUDA: straight between the device and the slots; the segment is not registered as
// pinned memory yet, so these copies are synchronous) and reductions run on the host, in the
// slots. Host and device ranks take the same steps, so a group may mix them.
//
// Local ranks are numbered by group rank; the functions take local indices for roots and blocks.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms/context.h"
#include "kernels/dtype.h"

namespace hetcomm {
namespace local {

// In place; when `divisor` > 0 (an AVG over the whole group) the result is divided by it before
// it is rounded to the dtype.
void allreduce(const CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op, double divisor);
// work holds counts[0] + ... + counts[L-1] elements (block l at the prefix offset); afterwards this
// rank's block holds the reduction of that block over the local ranks (divided as above). The
// other blocks keep this rank's input.
void reduceScatterv(const CollectiveContext& ctx, char* work, const std::vector<size_t>& counts, DType dtype,
                    RedOp op, double divisor);
// out holds every local rank's block back to back (block l is blockBytes[l] long); this rank's
// block must already be in place.
void allgatherv(const CollectiveContext& ctx, char* out, const std::vector<size_t>& blockBytes);
void broadcast(const CollectiveContext& ctx, char* buf, size_t bytes, int root);
void gather(const CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root);
void scatter(const CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root);
// As hetcomm::alltoallv; the sizes each pair of ranks expects are checked against each other.
void alltoallv(const CollectiveContext& ctx, const char* in, const std::vector<size_t>& sendOffsets,
               const std::vector<size_t>& sendBytes, char* out, const std::vector<size_t>& recvOffsets,
               const std::vector<size_t>& recvBytes);
void barrier(const CollectiveContext& ctx);

// Allreduces of at most this many bytes are reduced whole by every rank, which saves one of the
// three waits per chunk.
size_t smallAllreduceBytes();

}  // namespace local
}  // namespace hetcomm
