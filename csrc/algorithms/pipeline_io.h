#pragma once
// What the host pipeline (pipeline.cc) and the staged one (staged_pipeline.cc) share: the
// per-message header, its check, non-blocking I/O on the links and the errors they raise.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "algorithms/pipeline.h"
#include "transport/link.h"

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

// One non-blocking send/receive on the link to `peer`: the bytes moved, 0 when the link would
// block (EINTR is retried). A closed link or a failed one throws PeerClosedError naming the peer.
// The bytes moved are added to ctx.traffic: every collective byte on the wire passes through here.
size_t sendSome(const CollectiveContext& ctx, Link& link, int peer, const char* data, size_t len);
size_t recvSome(const CollectiveContext& ctx, Link& link, int peer, char* data, size_t len);

// Fills waits with what a pipeline waits for on its links (they may be one link, when the peers
// are the same): room on sendLink if wantOut, bytes on recvLink if wantIn. Returns the number of
// entries (0, 1 or 2).
int linksToWaitFor(LinkWait* waits, Link* sendLink, bool wantOut, Link* recvLink, bool wantIn);

// Sleeps until one of waits is ready, at most until the collective's deadline or, when
// maxWaitUs >= 0, for that many microseconds. Returns false if the deadline has passed.
bool waitReady(const CollectiveContext& ctx, LinkWait* waits, int n, int64_t maxWaitUs);

// The TimeoutError of a pipeline that stopped progressing.
[[noreturn]] void throwTimeout(const CollectiveContext& ctx, const PipelineSpec& spec, int waitingFor,
                               size_t received, size_t toReceive, size_t sent, size_t toSend);

}  // namespace pipeline_io
}  // namespace hetcomm
