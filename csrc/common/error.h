#pragma once
// Errors raised by the hetcomm core.
//
// Recoverable failures (a peer died, a timeout, garbage on a socket, ranks that disagree about a
// collective) throw CommError; the backend turns it into torch.distributed.DistBackendError on
// every rank that can know. Broken internal invariants use HC_ENFORCE, which throws
// std::logic_error: they are bugs, not user errors.
#include <sstream>
#include <stdexcept>
#include <string>

namespace hetcomm {

class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& what) : std::runtime_error(what) {}
};

// The connection to `peer` was closed or reset: the peer exited, crashed or gave up. The backend
// adds the peer's own reason when it left one in the store.
class PeerClosedError : public CommError {
 public:
  PeerClosedError(const std::string& what, int peer) : CommError(what), peer_(peer) {}
  int peer() const { return peer_; }

 private:
  int peer_;
};

// A CommError caused by a deadline passing (lets callers report ErrorType::TIMEOUT).
class TimeoutError : public CommError {
 public:
  explicit TimeoutError(const std::string& what) : CommError(what) {}
};

// Nothing listens at an address any more (ECONNREFUSED): for an address a peer published, the
// peer has exited or crashed.
class ConnectionRefusedError : public CommError {
 public:
  explicit ConnectionRefusedError(const std::string& what) : CommError(what) {}
};

// The c10d store could not be reached (its host died, or the network to it): the message says
// what was asked of it.
class StoreUnreachableError : public CommError {
 public:
  explicit StoreUnreachableError(const std::string& what) : CommError(what) {}
};

// A wait given up because the group is aborting or shutting down (see Cancelled).
class CancelledError : public CommError {
 public:
  explicit CancelledError(const std::string& what) : CommError(what) {}
};

namespace detail {
inline void appendAll(std::ostringstream&) {}
template <typename T, typename... Rest>
void appendAll(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  appendAll(os, rest...);
}
}  // namespace detail

template <typename... Args>
std::string strCat(const Args&... args) {
  std::ostringstream os;
  detail::appendAll(os, args...);
  return os.str();
}

// Text that came from outside (the store, a peer) as it may appear in an error message: at most
// `maxBytes` of it, printable ASCII kept, every other byte as \xNN (an error message reaches
// Python, which takes it as UTF-8: one stray byte would replace the whole error with a
// UnicodeDecodeError), and the length said when it was cut.
inline std::string excerpt(const std::string& text, size_t maxBytes = 200) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < text.size() && i < maxBytes; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kDigits[c >> 4];
      out += kDigits[c & 15];
    }
  }
  if (text.size() > maxBytes) out += strCat("... (", text.size(), " bytes)");
  return out;
}

}  // namespace hetcomm

#define HC_ENFORCE(cond, ...)                                                           \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      throw std::logic_error(::hetcomm::strCat("hetcomm internal error: ", #cond, " (", \
                                               __FILE__, ":", __LINE__, ") ",           \
                                               ##__VA_ARGS__));                         \
    }                                                                                   \
  } while (0)
