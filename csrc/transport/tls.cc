#include "transport/tls.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/env.h"

// OpenSSL's opaque types beside ssl_ctx_st and ssl_st (tls.h).
struct ssl_method_st;
struct bio_st;
struct bio_method_st;

namespace hetcomm {
namespace tls {

namespace {

using SSL_CTX = ssl_ctx_st;
using SSL = ssl_st;
using SSL_METHOD = ssl_method_st;
using BIO = bio_st;
using BIO_METHOD = bio_method_st;

// Constants of OpenSSL 3's ABI, from its headers (ssl.h, tls1.h, sslerr.h, bio.h, err.h, x509.h).
// Many of its "functions" are macros over SSL_CTX_ctrl; these are their command numbers.
constexpr int kCtrlMode = 33;                // SSL_CTRL_MODE: SSL_CTX_set_mode
constexpr int kCtrlSetMinProtoVersion = 123;  // SSL_CTRL_SET_MIN_PROTO_VERSION
constexpr int kCtrlSetMaxProtoVersion = 124;  // SSL_CTRL_SET_MAX_PROTO_VERSION
constexpr long kTls13Version = 0x0304;        // TLS1_3_VERSION
constexpr long kModeEnablePartialWrite = 0x1;        // SSL_MODE_ENABLE_PARTIAL_WRITE
constexpr long kModeAcceptMovingWriteBuffer = 0x2;  // SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER
constexpr uint64_t kOpNoRenegotiation = uint64_t{1} << 30;  // SSL_OP_NO_RENEGOTIATION
constexpr int kVerifyPeer = 0x01;                // SSL_VERIFY_PEER
constexpr int kVerifyFailIfNoPeerCert = 0x02;    // SSL_VERIFY_FAIL_IF_NO_PEER_CERT
constexpr int kFiletypePem = 1;                  // SSL_FILETYPE_PEM
constexpr long kX509VerifyOk = 0;                // X509_V_OK

// SSL_get_error() results.
constexpr int kErrorWantRead = 2;
constexpr int kErrorWantWrite = 3;
constexpr int kErrorSyscall = 5;
constexpr int kErrorZeroReturn = 6;

// ERR codes: ERR_GET_LIB / ERR_GET_REASON are inline functions over these.
constexpr unsigned long kErrSystemFlag = 0x80000000UL;  // ERR_SYSTEM_FLAG
constexpr int kErrLibOffset = 23;                        // ERR_LIB_OFFSET
constexpr unsigned long kErrLibMask = 0xFF;              // ERR_LIB_MASK
constexpr unsigned long kErrReasonMask = 0x7FFFFF;       // ERR_REASON_MASK
constexpr int kErrLibSsl = 20;                           // ERR_LIB_SSL
// SSL library reasons (SSL_R_*). A received alert is reason kAlertReasonOffset + its code.
constexpr int kReasonCertificateVerifyFailed = 134;
constexpr int kReasonHttpsProxyRequest = 155;
constexpr int kReasonHttpRequest = 156;
constexpr int kReasonPacketLengthTooLong = 198;
constexpr int kReasonPeerDidNotReturnACertificate = 199;
constexpr int kReasonRecordLengthMismatch = 213;
constexpr int kReasonWrongVersionNumber = 267;
constexpr int kAlertReasonOffset = 1000;  // SSL_AD_REASON_OFFSET

// TLS alert codes (RFC 8446 section 6) that mean "your certificate is not accepted".
bool isCertificateAlert(int alert) {
  switch (alert) {
    case 42:   // bad_certificate
    case 43:   // unsupported_certificate
    case 44:   // certificate_revoked
    case 45:   // certificate_expired
    case 46:   // certificate_unknown
    case 48:   // unknown_ca
    case 49:   // access_denied
    case 51:   // decrypt_error (the CertificateVerify signature did not verify)
    case 116:  // certificate_required
      return true;
    default:
      return false;
  }
}
constexpr int kAlertProtocolVersion = 70;

// BIO flags and control commands (bio.h).
constexpr int kBioFlagsRead = 0x01;
constexpr int kBioFlagsWrite = 0x02;
constexpr int kBioFlagsRws = 0x07;
constexpr int kBioFlagsShouldRetry = 0x08;
constexpr int kBioCtrlFlush = 11;
constexpr int kBioTypeSourceSink = 0x0400;

// Every OpenSSL function used, as (name, return type, parameters). Resolved by dlsym from libssl
// (whose dependency libcrypto provides the ERR_, BIO_ and X509_ ones).
#define HETCOMM_OPENSSL_FUNCTIONS(X)                                                 \
  X(OpenSSL_version_num, unsigned long, (void))                                     \
  X(OpenSSL_version, const char*, (int))                                            \
  X(OPENSSL_init_ssl, int, (uint64_t, const void*))                                 \
  X(TLS_method, const SSL_METHOD*, (void))                                          \
  X(SSL_CTX_new, SSL_CTX*, (const SSL_METHOD*))                                     \
  X(SSL_CTX_free, void, (SSL_CTX*))                                                 \
  X(SSL_CTX_ctrl, long, (SSL_CTX*, int, long, void*))                               \
  X(SSL_CTX_set_options, uint64_t, (SSL_CTX*, uint64_t))                            \
  X(SSL_CTX_set_num_tickets, int, (SSL_CTX*, size_t))                               \
  X(SSL_CTX_use_certificate_chain_file, int, (SSL_CTX*, const char*))               \
  X(SSL_CTX_use_PrivateKey_file, int, (SSL_CTX*, const char*, int))                 \
  X(SSL_CTX_check_private_key, int, (const SSL_CTX*))                               \
  X(SSL_CTX_load_verify_locations, int, (SSL_CTX*, const char*, const char*))       \
  X(SSL_CTX_set_verify, void, (SSL_CTX*, int, int (*)(int, void*)))                 \
  X(SSL_new, SSL*, (SSL_CTX*))                                                      \
  X(SSL_free, void, (SSL*))                                                         \
  X(SSL_set_bio, void, (SSL*, BIO*, BIO*))                                          \
  X(SSL_set_accept_state, void, (SSL*))                                             \
  X(SSL_set_connect_state, void, (SSL*))                                            \
  X(SSL_do_handshake, int, (SSL*))                                                  \
  X(SSL_read_ex, int, (SSL*, void*, size_t, size_t*))                               \
  X(SSL_write_ex, int, (SSL*, const void*, size_t, size_t*))                        \
  X(SSL_get_error, int, (const SSL*, int))                                          \
  X(SSL_pending, int, (const SSL*))                                                 \
  X(SSL_shutdown, int, (SSL*))                                                      \
  X(SSL_get_verify_result, long, (const SSL*))                                      \
  X(SSL_alert_desc_string_long, const char*, (int))                                 \
  X(X509_verify_cert_error_string, const char*, (long))                             \
  X(ERR_get_error, unsigned long, (void))                                           \
  X(ERR_peek_error, unsigned long, (void))                                          \
  X(ERR_clear_error, void, (void))                                                  \
  X(ERR_error_string_n, void, (unsigned long, char*, size_t))                       \
  X(ERR_reason_error_string, const char*, (unsigned long))                          \
  X(BIO_get_new_index, int, (void))                                                 \
  X(BIO_meth_new, BIO_METHOD*, (int, const char*))                                  \
  X(BIO_meth_set_write, int, (BIO_METHOD*, int (*)(BIO*, const char*, int)))        \
  X(BIO_meth_set_read, int, (BIO_METHOD*, int (*)(BIO*, char*, int)))               \
  X(BIO_meth_set_ctrl, int, (BIO_METHOD*, long (*)(BIO*, int, long, void*)))        \
  X(BIO_new, BIO*, (const BIO_METHOD*))                                             \
  X(BIO_set_data, void, (BIO*, void*))                                              \
  X(BIO_get_data, void*, (BIO*))                                                    \
  X(BIO_set_init, void, (BIO*, int))                                                \
  X(BIO_set_flags, void, (BIO*, int))                                               \
  X(BIO_clear_flags, void, (BIO*, int))

struct OpenSsl {
#define HETCOMM_DECLARE_POINTER(name, ret, params) ret(*name) params = nullptr;
  HETCOMM_OPENSSL_FUNCTIONS(HETCOMM_DECLARE_POINTER)
#undef HETCOMM_DECLARE_POINTER
  BIO_METHOD* socketMethod = nullptr;  // our BIO: ::send(MSG_NOSIGNAL) and ::recv on an fd
};

// Filled once by load(); read-only afterwards. `gSsl` is only used once available() said yes
// (a Context exists), so the I/O paths read it without synchronisation of their own: creating
// the Context happened before, through call_once.
OpenSsl gSsl;
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

void load() {
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

// Every error in OpenSSL's (per-thread) queue, oldest first, which empties it.
std::vector<unsigned long> takeErrors() {
  std::vector<unsigned long> errors;
  for (unsigned long e = gSsl.ERR_get_error(); e != 0; e = gSsl.ERR_get_error()) errors.push_back(e);
  return errors;
}

// "error:0A00018F:SSL routines::ee key too small; ..." for the queued errors, or `fallback`.
std::string errorQueueText(const std::string& fallback = "no reason given") {
  std::string text;
  for (unsigned long e : takeErrors()) {
    char buf[256];
    gSsl.ERR_error_string_n(e, buf, sizeof(buf));
    text += strCat(text.empty() ? "" : "; ", buf);
  }
  return text.empty() ? fallback : text;
}

std::string reasonText(unsigned long e) {
  const char* r = gSsl.ERR_reason_error_string(e);
  return r != nullptr ? r : strCat("error code ", e);
}

}  // namespace

bool available(std::string* why) {
  std::call_once(gLoadOnce, load);
  if (!gLoaded && why != nullptr) *why = gWhyNot;
  return gLoaded;
}

// --- configuration ----------------------------------------------------------------------------

const char* modeName(Config::Mode mode) {
  switch (mode) {
    case Config::Mode::kOff:
      return "off";
    case Config::Mode::kInterSite:
      return "inter-site";
    case Config::Mode::kAll:
      return "all";
  }
  return "?";
}

Config configFromEnv() {
  Config config;
  const std::string mode = envStr("HETCOMM_TLS", "off");
  if (mode == "off") return config;
  if (mode == "all") {
    config.mode = Config::Mode::kAll;
  } else if (mode == "inter-site") {
    config.mode = Config::Mode::kInterSite;
  } else {
    throw TlsError(strCat("hetcomm: HETCOMM_TLS=", mode, " is not one of all, inter-site, off"));
  }
  const struct {
    const char* variable;
    std::string* field;
    const char* meaning;
  } files[] = {{"HETCOMM_TLS_CERT", &config.cert, "this process's certificate chain"},
               {"HETCOMM_TLS_KEY", &config.key, "the private key of that certificate"},
               {"HETCOMM_TLS_CA", &config.ca, "the CA certificates that sign the peers' certificates"}};
  for (const auto& f : files) {
    *f.field = envStr(f.variable);
    if (f.field->empty()) {
      throw TlsError(strCat("hetcomm: HETCOMM_TLS=", mode, " needs ", f.variable, ": the PEM file of ", f.meaning));
    }
  }
  return config;
}

// --- Context ----------------------------------------------------------------------------------

namespace {

// Throws unless `path` (the value of `variable`) names a file this process can read: OpenSSL's
// own words for a missing file are three lines of "system lib".
void checkReadable(const char* variable, const std::string& path) {
  if (path.empty()) throw TlsError(strCat("hetcomm: TLS needs ", variable, " (a PEM file) but it is not set"));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw TlsError(strCat("hetcomm: cannot read ", variable, "=", path, ": ", std::strerror(errno)));
  ::close(fd);
}

}  // namespace

Context::~Context() { gSsl.SSL_CTX_free(ctx_); }

std::shared_ptr<Context> Context::create(const Config& config) {
  std::string why;
  if (!available(&why)) {
    throw TlsError(strCat("hetcomm: TLS requested (HETCOMM_TLS=", modeName(config.mode),
                          ") but OpenSSL could not be loaded: ", why));
  }
  checkReadable("HETCOMM_TLS_CERT", config.cert);
  checkReadable("HETCOMM_TLS_KEY", config.key);
  checkReadable("HETCOMM_TLS_CA", config.ca);
  const OpenSsl& s = gSsl;
  s.ERR_clear_error();
  SSL_CTX* ctx = s.SSL_CTX_new(s.TLS_method());
  if (ctx == nullptr) throw TlsError(strCat("hetcomm: SSL_CTX_new failed: ", errorQueueText()));
  std::shared_ptr<Context> context(new Context(ctx));  // frees ctx if a check below throws

  if (s.SSL_CTX_ctrl(ctx, kCtrlSetMinProtoVersion, kTls13Version, nullptr) != 1 ||
      s.SSL_CTX_ctrl(ctx, kCtrlSetMaxProtoVersion, kTls13Version, nullptr) != 1) {
    throw TlsError(strCat("hetcomm: this OpenSSL cannot be limited to TLS 1.3: ", errorQueueText()));
  }
  s.SSL_CTX_set_options(ctx, kOpNoRenegotiation);
  // Partial writes give write() ::send's semantics (one record taken is progress); a moving
  // buffer lets a retry after EAGAIN pass the same bytes from another address.
  s.SSL_CTX_ctrl(ctx, kCtrlMode, kModeEnablePartialWrite | kModeAcceptMovingWriteBuffer, nullptr);
  // Every connection is new and lives as long as the group: no resumption, and no tickets that a
  // TLS 1.3 server would otherwise send after the handshake.
  s.SSL_CTX_set_num_tickets(ctx, 0);

  if (s.SSL_CTX_use_certificate_chain_file(ctx, config.cert.c_str()) != 1) {
    throw TlsError(strCat("hetcomm: cannot load the certificate chain HETCOMM_TLS_CERT=", config.cert, ": ",
                          errorQueueText()));
  }
  // OpenSSL checks the key against the certificate already here, and again (whole chain) below.
  if (s.SSL_CTX_use_PrivateKey_file(ctx, config.key.c_str(), kFiletypePem) != 1 || s.SSL_CTX_check_private_key(ctx) != 1) {
    throw TlsError(strCat("hetcomm: the private key HETCOMM_TLS_KEY=", config.key,
                          " cannot be used with the certificate HETCOMM_TLS_CERT=", config.cert,
                          " (a key that does not match it, or a file that is no PEM private key): ", errorQueueText()));
  }
  if (s.SSL_CTX_load_verify_locations(ctx, config.ca.c_str(), nullptr) != 1) {
    throw TlsError(strCat("hetcomm: cannot load the CA certificates HETCOMM_TLS_CA=", config.ca, ": ",
                          errorQueueText("the file holds no PEM certificate")));
  }
  s.SSL_CTX_set_verify(ctx, kVerifyPeer | kVerifyFailIfNoPeerCert, nullptr);
  return context;
}

// --- Session ----------------------------------------------------------------------------------

namespace {
// The byte a server sends after its handshake to tell the client it accepted its certificate.
constexpr uint8_t kConfirmByte = 0x5a;
}  // namespace

Session::~Session() {
  // SSL_free frees the BIO too; neither writes anything (see the class comment).
  if (ssl_ != nullptr) gSsl.SSL_free(ssl_);
}

std::unique_ptr<Session> Session::handshake(const Context& context, int fd, bool server, Deadline deadline,
                                            const Cancelled& cancelled, const std::function<std::string()>& what) {
  const OpenSsl& s = gSsl;
  std::unique_ptr<Session> session(new Session(fd));
  s.ERR_clear_error();
  session->ssl_ = s.SSL_new(context.ctx_);
  BIO* bio = session->ssl_ != nullptr ? s.BIO_new(s.socketMethod) : nullptr;
  if (bio == nullptr) {
    throw TlsError(strCat("hetcomm: TLS handshake with ", what(), " failed: out of memory: ", errorQueueText()));
  }
  s.BIO_set_data(bio, &session->io_);
  s.BIO_set_init(bio, 1);
  s.SSL_set_bio(session->ssl_, bio, bio);  // one reference, for both directions; SSL_free frees it
  SSL* ssl = session->ssl_;
  if (server) {
    s.SSL_set_accept_state(ssl);
  } else {
    s.SSL_set_connect_state(ssl);
  }
  session->driveHandshake([&] { return s.SSL_do_handshake(ssl); }, deadline, cancelled, what);

  uint8_t byte = kConfirmByte;
  size_t moved = 0;
  if (server) {
    session->driveHandshake([&] { return s.SSL_write_ex(ssl, &byte, 1, &moved); }, deadline, cancelled, what);
  } else {
    session->driveHandshake([&] { return s.SSL_read_ex(ssl, &byte, 1, &moved); }, deadline, cancelled, what);
    if (byte != kConfirmByte) {
      throw TlsError(strCat("hetcomm: TLS handshake with ", what(), " failed: the peer sent application data (",
                            static_cast<int>(byte), ") instead of confirming the handshake: is it a hetcomm of the same version?"));
    }
  }
  return session;
}

void Session::driveHandshake(const std::function<int()>& step, Deadline deadline, const Cancelled& cancelled,
                             const std::function<std::string()>& what) {
  while (true) {
    gSsl.ERR_clear_error();
    io_.lastErrno = 0;
    const int rc = step();
    if (rc == 1) return;
    const int err = gSsl.SSL_get_error(ssl_, rc);
    if (err != kErrorWantRead && err != kErrorWantWrite) {
      const bool lost = (err == kErrorZeroReturn || err == kErrorSyscall) && io_.lastErrno != EAGAIN;
      const bool queued = gSsl.ERR_peek_error() != 0;  // an OpenSSL error: not a bare TCP end
      const std::string why = strCat("hetcomm: TLS handshake with ", what(), " failed: ", describeFailure(err, true));
      if (lost && !queued) throw TlsConnectionLost(why);
      throw TlsError(why);
    }
    pollfd pfd{io_.fd, static_cast<short>(err == kErrorWantRead ? POLLIN : POLLOUT), 0};
    while (true) {
      if (cancelled && cancelled()) {
        throw CancelledError(strCat("hetcomm: gave up the TLS handshake with ", what(), ": the process group is shutting down"));
      }
      const int left = msUntil(deadline);
      if (left == 0) {
        throw TimeoutError(strCat("hetcomm: TLS handshake with ", what(), " timed out: the peer did not answer before the "
                                  "deadline (is it overloaded, or not running the handshake at all?)"));
      }
      const int rc = ::poll(&pfd, 1, cancelled ? std::min(left, kCancelPollMs) : left);
      if (rc > 0) break;  // ready, or an error that the next SSL call reports
      if (rc < 0 && errno != EINTR) {
        throw TlsError(strCat("hetcomm: TLS handshake with ", what(), " failed: poll: ", std::strerror(errno)));
      }
    }
  }
}

std::string Session::describeFailure(int sslError, bool handshaking) const {
  const std::vector<unsigned long> errors = takeErrors();
  if (errors.empty()) {
    if (sslError == kErrorZeroReturn || (sslError == kErrorSyscall && (io_.eof || io_.lastErrno == 0))) {
      return handshaking ? "the peer closed the connection (is TLS enabled alike on every rank, and did the peer "
                           "accept our certificate?)"
                         : "the peer closed the connection";
    }
    if (sslError == kErrorSyscall) return strCat("the connection failed: ", std::strerror(io_.lastErrno));
    return strCat("SSL_get_error() = ", sslError, " with no reason given");
  }
  // The first error of the SSL library is the cause; later ones (and other libraries') are context.
  unsigned long cause = errors.front();
  for (unsigned long e : errors) {
    if ((e & kErrSystemFlag) == 0 && static_cast<int>((e >> kErrLibOffset) & kErrLibMask) == kErrLibSsl) {
      cause = e;
      break;
    }
  }
  const int reason = (cause & kErrSystemFlag) != 0 ? 0 : static_cast<int>(cause & kErrReasonMask);
  if (reason == kReasonCertificateVerifyFailed) {
    const long result = gSsl.SSL_get_verify_result(ssl_);
    return strCat("the peer's certificate was rejected: ",
                  result != kX509VerifyOk ? gSsl.X509_verify_cert_error_string(result) : reasonText(cause));
  }
  if (reason == kReasonPeerDidNotReturnACertificate) {
    return "the peer sent no certificate (does it run with HETCOMM_TLS_CERT set?)";
  }
  if (reason >= kAlertReasonOffset && reason < kAlertReasonOffset + 256) {
    const int alert = reason - kAlertReasonOffset;
    const std::string desc = gSsl.SSL_alert_desc_string_long(alert);
    if (!handshaking) return strCat("the peer ended the connection with a fatal alert: ", desc);
    if (isCertificateAlert(alert)) return strCat("the peer refused our certificate (alert: ", desc, ")");
    if (alert == kAlertProtocolVersion) return strCat("the peer does not accept TLS 1.3 (alert: ", desc, ")");
    return strCat("the peer aborted the handshake (alert: ", desc, ")");
  }
  switch (reason) {
    case kReasonWrongVersionNumber:
    case kReasonHttpRequest:
    case kReasonHttpsProxyRequest:
    case kReasonPacketLengthTooLong:
    case kReasonRecordLengthMismatch:
      if (!handshaking) return strCat("bytes that are no TLS record arrived (", reasonText(cause), ")");
      return strCat("the peer is not speaking TLS (what it sent is no TLS record: ", reasonText(cause),
                    "); is HETCOMM_TLS set alike on every rank?");
    default:
      break;
  }
  std::string text = strCat("TLS error: ", reasonText(cause));
  for (unsigned long e : errors) {
    if (e != cause) text += strCat("; ", reasonText(e));
  }
  return text;
}

void Session::recordFailure(int sslError, const char* doing) {
  if (sslError == kErrorSyscall && io_.lastErrno != 0 && io_.lastErrno != EAGAIN && io_.lastErrno != EWOULDBLOCK) {
    gSsl.ERR_clear_error();
    failedErrno_ = io_.lastErrno;
    lastError_ = strCat("TLS ", doing, " failed: ", std::strerror(failedErrno_));
    return;
  }
  // A TLS protocol failure: a record that does not decrypt, an alert from the peer, ...
  failedErrno_ = EPROTO;
  lastError_ = strCat("TLS ", doing, " failed: ", describeFailure(sslError, false));
}

ssize_t Session::write(const void* data, size_t len) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failedErrno_ != 0 || writeShut_) {
    errno = failedErrno_ != 0 ? failedErrno_ : EPIPE;
    return -1;
  }
  if (len == 0) return 0;
  // One SSL_write_ex: with partial writes it returns once a record (up to 16 KB) has left, or
  // fails with WANT_WRITE holding a record it could not send whole. Calling it again after a
  // success would be wrong: a WANT_WRITE then would leave bytes in OpenSSL that the caller, told
  // of the earlier success, need not offer again (the retry rule in tls.h).
  gSsl.ERR_clear_error();
  io_.lastErrno = 0;
  size_t written = 0;
  const int rc = gSsl.SSL_write_ex(ssl_, data, len, &written);
  if (rc == 1) return static_cast<ssize_t>(written);
  const int err = gSsl.SSL_get_error(ssl_, rc);
  if (err == kErrorWantWrite || err == kErrorWantRead) {
    errno = EAGAIN;
    return -1;
  }
  recordFailure(err, "send");
  errno = failedErrno_;
  return -1;
}

ssize_t Session::read(void* data, size_t len) {
  std::lock_guard<std::mutex> lock(mutex_);
  unreported_ = false;
  if (closed_) return 0;
  if (failedErrno_ != 0) {
    errno = failedErrno_;
    return -1;
  }
  if (len == 0) return 0;
  char* p = static_cast<char*>(data);
  size_t total = 0;
  // SSL_read_ex returns at most one record's bytes; go on until the caller's buffer is full or
  // OpenSSL needs bytes from the socket, so that a short read leaves nothing decrypted behind
  // (see pending()).
  while (total < len) {
    gSsl.ERR_clear_error();
    io_.lastErrno = 0;
    size_t got = 0;
    const int rc = gSsl.SSL_read_ex(ssl_, p + total, len - total, &got);
    if (rc == 1) {
      total += got;
      continue;
    }
    const int err = gSsl.SSL_get_error(ssl_, rc);
    if (err == kErrorWantRead || err == kErrorWantWrite) break;
    // close_notify, or a TCP EOF without one (our BIO answers "not at EOF" to OpenSSL, which then
    // reports SSL_ERROR_SYSCALL with nothing queued instead of a fatal "unexpected EOF").
    if (err == kErrorZeroReturn || (err == kErrorSyscall && io_.eof)) {
      gSsl.ERR_clear_error();
      closed_ = true;
    } else {
      recordFailure(err, "receive");
    }
    unreported_ = total > 0;
    break;
  }
  if (total > 0) return static_cast<ssize_t>(total);
  if (closed_) return 0;
  errno = failedErrno_ != 0 ? failedErrno_ : EAGAIN;
  return -1;
}

bool Session::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return unreported_ || (failedErrno_ == 0 && !closed_ && gSsl.SSL_pending(ssl_) > 0);
}

std::string Session::lastError() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lastError_;
}

void Session::closeNotify() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failedErrno_ != 0 || writeShut_) return;  // OpenSSL forbids SSL_shutdown after a fatal error
  gSsl.ERR_clear_error();
  gSsl.SSL_shutdown(ssl_);  // sends close_notify; does not wait for the peer's
  gSsl.ERR_clear_error();
  writeShut_ = true;
}

}  // namespace tls
}  // namespace hetcomm
