#pragma once
// Link: one connection to one peer as everything above the transports sees it (the collective
// algorithms, the point-to-point engine, the handshakes of the mesh): bytes out, bytes in, and
// readiness. Nothing above this seam sees a file descriptor or calls TLS. Which kind a pair of
// ranks gets is the mesh's choice, per pair (tcp_mesh.h: TLS where HETCOMM_TLS's policy says so,
// TCP otherwise); the inner level of a host (algorithms/inner_level.h: shared memory, Gloo, NCCL)
// is the other implementation of "how these ranks reach each other", for the ranks of one host.
// Gloo's transport/pair.h and NCCL's per-peer transport table are the models.
//
// Kinds:
//  * TCP: a connected, non-blocking socket.
//  * TLS: the same socket carrying a TLS 1.3 session (tls.h). Bytes OpenSSL has already decrypted
//    but the caller has not read count as receivable without the socket being readable, so a
//    waiter never sleeps on them.
//  * Shared memory (shm/ring_link.h): a point-to-point link between two ranks of one host, one
//    direction of data through a ring in shared memory, its TCP link kept as the doorbell. Both
//    ends sleep on the doorbell's input (pollEvents), and a ring with bytes or room in it counts
//    as ready without sleeping (receivable, sendable).
//
// One thread at a time sends on a link and one at a time receives (the two may differ: a TLS
// session serialises them); shutdown() and hungUp() may come from any thread.
#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "transport/socket.h"

namespace hetcomm {
namespace tls {
class Session;
}

class Link {
 public:
  enum class Kind : uint8_t { kTcp, kTls, kShm };
  virtual ~Link() = default;
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  virtual Kind kind() const = 0;
  // The TLS session of a TLS link (its peer's certificate); null for the other kinds.
  virtual const tls::Session* tlsSession() const { return nullptr; }
  const char* kindName() const { return kind() == Kind::kTls ? "tls" : kind() == Kind::kShm ? "shm" : "tcp"; }
  // ::send semantics, without SIGPIPE: bytes taken (> 0), or -1 with errno (EAGAIN: nothing can
  // move now; EINTR: try again; EPIPE, ECONNRESET, ...: the link failed). On TLS a send that
  // would block has taken the bytes into a record already: the next send must offer the same
  // bytes again first (tls.h), which every writer that retries what is left of its message does.
  virtual ssize_t send(const void* data, size_t len) = 0;
  // ::recv semantics: bytes read (> 0), 0 when the peer closed the link, or -1 with errno
  // (EAGAIN: nothing now; EINTR; anything else: the link failed).
  virtual ssize_t recv(void* data, size_t len) = 0;
  // Wakes every thread waiting on the link, both directions, and makes later I/O on it fail (the
  // peer sees the link close). Any thread, any time before destruction.
  virtual void shutdown() = 0;

  // For waitLinks() and the transports that wait on links among other things (the
  // point-to-point engine's wake-up pipe): the descriptor whose readiness means the link can
  // move, and whether a receive returns at once without it (bytes buffered above the socket, or
  // a close or an error still to report).
  virtual int pollFd() const = 0;
  virtual bool receivable() const { return false; }
  // ... whether a send takes bytes at once without it (room in a ring) ...
  virtual bool sendable() const { return false; }
  // ... and the poll events on pollFd() that mean "try again" for a waiter in these directions.
  virtual short pollEvents(bool send, bool recv) const;
  // True when the peer has certainly closed its end or the link failed (a reset, a hang-up);
  // looks without waiting and without reading, so it may be asked while another thread uses the
  // link (the shared-memory collectives ask it of a peer they wait for: is it still there?).
  bool hungUp() const;
  // Caps the rate at which the kernel sends this link's bytes (SO_MAX_PACING_RATE, TCP's own
  // pacing: no qdisc needed), in bytes per second; 0 lifts the cap. TCP and TLS links only (a
  // shared-memory link leaves the host through no NIC: true, nothing to do). False when the
  // kernel refused the option.
  bool pace(uint64_t bytesPerSecond);
  // The cap the kernel holds for the link now (bytes/s; 0: none, or a shared-memory link).
  uint64_t pacing() const;

 protected:
  Link() = default;
};

// A TCP link over a connected socket; a TLS link over a socket whose session finished its
// handshake (tls::Session::handshake).
std::unique_ptr<Link> tcpLink(Socket socket);
std::unique_ptr<Link> tlsLink(Socket socket, std::unique_ptr<tls::Session> session);

// One link a waiter waits for, and in which directions.
struct LinkWait {
  Link* link = nullptr;
  bool send = false;   // wake when it can take bytes
  bool recv = false;   // wake when it has bytes (or a close or an error to report)
  bool ready = false;  // out: it can (or it failed: the next send/recv says how)
};

// Sleeps until one of `waits` is ready, until `timeout` (negative: no limit) or a signal, or
// until `wakeFd` (>= 0) becomes readable (*woken then says so). Entries may name the same link.
// Returns the number of ready entries (0: the time ran out, or a signal), or -1 with errno when
// the wait itself failed. A receivable() link does not sleep at all.
int waitLinks(LinkWait* waits, size_t n, std::chrono::nanoseconds timeout, int wakeFd = -1, bool* woken = nullptr);

// Blocking-until-deadline transfers of a whole message on a link (the handshakes). `what` builds
// the context of the error message lazily ("connecting to rank 3 at 10.0.0.5:4711"); a link that
// closes or fails throws CommError, the deadline TimeoutError, `cancelled` CancelledError.
void sendAll(Link& link, const void* data, size_t len, Deadline deadline, const std::function<std::string()>& what,
             const Cancelled& cancelled = {});
void recvAll(Link& link, void* data, size_t len, Deadline deadline, const std::function<std::string()>& what,
             const Cancelled& cancelled = {});

}  // namespace hetcomm
