#include "transport/tls_openssl.h"

#include <dlfcn.h>
#include <errno.h>
#include <sys/socket.h>

#include <mutex>
#include <vector>

#include "common/env.h"
#include "common/error.h"
#include "transport/tls.h"

namespace hetcomm {
namespace tls {
namespace abi {

OpenSsl gSsl;

namespace {

// BIO flags and control commands (bio.h).
constexpr int kBioFlagsRead = 0x01;
constexpr int kBioFlagsWrite = 0x02;
constexpr int kBioFlagsRws = 0x07;
constexpr int kBioFlagsShouldRetry = 0x08;
constexpr int kBioCtrlFlush = 11;
constexpr int kBioTypeSourceSink = 0x0400;

std::once_flag gLoadOnce;
bool gLoaded = false;
std::string gWhyNot;

// --- the socket BIO ---------------------------------------------------------------------------
// OpenSSL's own socket BIO writes with write(), which raises SIGPIPE on a connection the peer has
// closed; ours sends with MSG_NOSIGNAL and keeps errno for the session (OpenSSL may overwrite
// errno before SSL_get_error is asked).

int bioWrite(BIO* bio, const char* data, int len) {
  auto* io = static_cast<detail::SocketIo*>(gSsl.BIO_get_data(bio));
  gSsl.BIO_clear_flags(bio, kBioFlagsRws | kBioFlagsShouldRetry);
  while (true) {
    const ssize_t n = ::send(io->fd, data, static_cast<size_t>(len), MSG_NOSIGNAL);
    if (n >= 0) return static_cast<int>(n);
    if (errno == EINTR) continue;
    io->lastErrno = errno;
    if (errno == EAGAIN || errno == EWOULDBLOCK) gSsl.BIO_set_flags(bio, kBioFlagsWrite | kBioFlagsShouldRetry);
    return -1;
  }
}

int bioRead(BIO* bio, char* data, int len) {
  auto* io = static_cast<detail::SocketIo*>(gSsl.BIO_get_data(bio));
  gSsl.BIO_clear_flags(bio, kBioFlagsRws | kBioFlagsShouldRetry);
  while (true) {
    const ssize_t n = ::recv(io->fd, data, static_cast<size_t>(len), 0);
    if (n > 0) return static_cast<int>(n);
    if (n == 0) {
      io->eof = true;
      return 0;
    }
    if (errno == EINTR) continue;
    io->lastErrno = errno;
    if (errno == EAGAIN || errno == EWOULDBLOCK) gSsl.BIO_set_flags(bio, kBioFlagsRead | kBioFlagsShouldRetry);
    return -1;
  }
}

// OpenSSL flushes after each handshake flight and fails the handshake if that fails; there is
// nothing to flush (every write goes straight to the socket). Everything else is unsupported.
long bioCtrl(BIO*, int cmd, long, void*) { return cmd == kBioCtrlFlush ? 1 : 0; }

// --- loading ----------------------------------------------------------------------------------

std::string dlerrorText() {
  const char* e = dlerror();
  return e != nullptr ? e : "unknown error";
}

void loadOnce() {
  std::vector<std::string> candidates;
  const std::string configured = envStr("HETCOMM_TLS_LIBSSL");
  if (!configured.empty()) {
    candidates.push_back(configured);  // only that one: it may be meant to simulate no OpenSSL
  } else {
    candidates = {"libssl.so.3", "libssl.so"};
  }
  void* handle = nullptr;
  std::string name, failures;
  for (const std::string& candidate : candidates) {
    // RTLD_LOCAL: another OpenSSL the process may already hold (Python's ssl module) keeps its
    // own symbols; dlsym on this handle searches libssl and its dependencies only.
    handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) {
      name = candidate;
      break;
    }
    failures += strCat(failures.empty() ? "" : "; ", "dlopen(", candidate, "): ", dlerrorText());
  }
  if (handle == nullptr) {
    gWhyNot = failures + (configured.empty() ? " (install OpenSSL 3, or point HETCOMM_TLS_LIBSSL at its libssl)" : "");
    return;
  }
  OpenSsl ssl;
  std::string missing;
#define HETCOMM_RESOLVE(fn, ret, params)                                                \
  ssl.fn = reinterpret_cast<ret(*) params>(dlsym(handle, #fn));                         \
  if (ssl.fn == nullptr) missing += strCat(missing.empty() ? "" : ", ", #fn);
  HETCOMM_OPENSSL_FUNCTIONS(HETCOMM_RESOLVE)
#undef HETCOMM_RESOLVE
  if (!missing.empty()) {
    gWhyNot = strCat(name, " lacks ", missing, " (hetcomm needs OpenSSL 3)");
    dlclose(handle);
    return;
  }
  // OpenSSL 3 changed the layout of error codes (ERR_GET_REASON) that the messages decode.
  if (ssl.OpenSSL_version_num() < 0x30000000UL) {
    gWhyNot = strCat(name, " is ", ssl.OpenSSL_version(0), "; hetcomm needs OpenSSL 3");
    dlclose(handle);
    return;
  }
  if (ssl.OPENSSL_init_ssl(0, nullptr) != 1) {
    gWhyNot = strCat(name, ": OPENSSL_init_ssl failed");
    return;  // OpenSSL may be half-initialised: keep it mapped
  }
  ssl.socketMethod = ssl.BIO_meth_new(ssl.BIO_get_new_index() | kBioTypeSourceSink, "hetcomm socket");
  if (ssl.socketMethod == nullptr || ssl.BIO_meth_set_write(ssl.socketMethod, bioWrite) != 1 ||
      ssl.BIO_meth_set_read(ssl.socketMethod, bioRead) != 1 || ssl.BIO_meth_set_ctrl(ssl.socketMethod, bioCtrl) != 1) {
    gWhyNot = strCat(name, ": cannot create a BIO method");
    return;
  }
  gSsl = ssl;
  gLoaded = true;
}

}  // namespace

bool load(std::string* why) {
  std::call_once(gLoadOnce, loadOnce);
  if (!gLoaded && why != nullptr) *why = gWhyNot;
  return gLoaded;
}

}  // namespace abi
}  // namespace tls
}  // namespace hetcomm
