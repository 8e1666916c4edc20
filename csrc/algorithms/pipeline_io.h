#pragma once
// What the host pipeline (pipeline.cc) and the staged one (staged_pipeline.cc) share: the
// per-message header, its check, non-blocking socket I/O and the errors they raise.
#include <poll.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "algorithms/pipeline.h"

namespace hetcomm {
namespace pipeline_io {

constexpr size_t kHeaderBytes = CollectiveHeader::kBytes;

// The header this rank sends on spec's send link, and the one it expects on its receive link.
CollectiveHeader outgoingHeader(const CollectiveContext& ctx, const PipelineSpec& spec);
CollectiveHeader expectedHeader(const CollectiveContext& ctx, const PipelineSpec& spec);
// What differs between two headers of one collective, for error messages ("dtype float16 vs
// float32, 64 bytes vs 128 bytes").
std::string describeMismatch(const CollectiveHeader& want, const CollectiveHeader& got);
// Throws CommError if the received header is garbage or describes another collective.
void checkHeader(const CollectiveContext& ctx, const PipelineSpec& spec, const uint8_t* bytes,
                 const CollectiveHeader& want);

// One non-blocking send()/recv(): the bytes moved, 0 when the socket would block (EINTR is
// retried). A closed connection or a socket error throws PeerClosedError naming the peer. The
// bytes moved are added to ctx.traffic: every collective byte on the wire passes through here.
size_t sendSome(const CollectiveContext& ctx, int fd, int peer, const char* data, size_t len);
size_t recvSome(const CollectiveContext& ctx, int fd, int peer, char* data, size_t len);

// Fills fds with what a pipeline waits for on its sockets (they may be one socket, when the
// peers are the same): writability of sfd if wantOut, readability of rfd if wantIn. Returns the
// number of entries (0, 1 or 2).
int socketsToWaitFor(pollfd* fds, int sfd, bool wantOut, int rfd, bool wantIn);

// Sleeps in poll() until one of fds is ready, at most until the collective's deadline or, when
// maxWaitUs >= 0, for that many microseconds. Returns false if the deadline has passed.
bool waitReady(const CollectiveContext& ctx, pollfd* fds, int nfds, int64_t maxWaitUs);

// The TimeoutError of a pipeline that stopped progressing.
[[noreturn]] void throwTimeout(const CollectiveContext& ctx, const PipelineSpec& spec, int waitingFor,
                               size_t received, size_t toReceive, size_t sent, size_t toSend);

}  // namespace pipeline_io
}  // namespace hetcomm
