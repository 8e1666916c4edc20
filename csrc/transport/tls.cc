#include "transport/tls.h"

#include <arpa/inet.h>
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
#include "transport/tls_openssl.h"

namespace hetcomm {
namespace tls {

namespace {

using namespace abi;  // NOLINT: OpenSSL's names, as its own headers would give them

// Constants of OpenSSL 3's ABI, from its headers (ssl.h, tls1.h, sslerr.h, err.h, x509.h).
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

// Whether `cert` names `host` (Session::namesHost); when not, *names says whom it names.
bool certificateNames(X509* cert, const std::string& host, std::string* names) {
  if (cert == nullptr) {
    if (names != nullptr) *names = "no certificate";
    return false;
  }
  // A link-local IPv6 address's zone ("fe80::1%eth0") is this host's, no part of the address.
  const std::string address = host.substr(0, host.find('%'));
  unsigned char ip[16];
  const bool literal =
      ::inet_pton(AF_INET, address.c_str(), ip) == 1 || ::inet_pton(AF_INET6, address.c_str(), ip) == 1;
  // 1: named; 0: not; negative: malformed input or out of memory, which names nothing either. An
  // empty host is named by none (X509_check_host would compare it with a possibly empty CN).
  const int named = host.empty()  ? 0
                    : literal     ? gSsl.X509_check_ip_asc(cert, address.c_str(), 0)
                                  : gSsl.X509_check_host(cert, host.data(), host.size(), 0, nullptr);
  gSsl.ERR_clear_error();
  if (named == 1) return true;
  if (names != nullptr) {
    char subject[256] = {0};
    const X509_NAME* name = gSsl.X509_get_subject_name(cert);
    if (name == nullptr || gSsl.X509_NAME_oneline(name, subject, sizeof(subject)) == nullptr) subject[0] = 0;
    *names = subject[0] != 0 ? subject : "a certificate without a subject";
  }
  return false;
}

}  // namespace

bool available(std::string* why) { return load(why); }

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
  const std::string verify = envStr("HETCOMM_TLS_VERIFY_NAME", "off");
  if (verify != "off" && verify != "host") {
    throw TlsError(strCat("hetcomm: HETCOMM_TLS_VERIFY_NAME=", excerpt(verify, 64), " is not one of host, off"));
  }
  const bool verifyHost = verify == "host";
  if (mode == "off") {
    if (verifyHost) {
      throw TlsError("hetcomm: HETCOMM_TLS_VERIFY_NAME=host checks the names in TLS certificates, but HETCOMM_TLS is "
                     "off: set HETCOMM_TLS=all or inter-site too");
    }
    return config;
  }
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
  config.verifyHost = verifyHost;
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

bool Context::namesHost(const std::string& host, std::string* names) const {
  return certificateNames(gSsl.SSL_CTX_get0_certificate(ctx_), host, names);
}

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
  std::shared_ptr<Context> context(new Context(ctx, config.verifyHost));  // frees ctx if a check below throws

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

bool Session::namesHost(const std::string& host, std::string* names) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return certificateNames(gSsl.SSL_get0_peer_certificate(ssl_), host, names);
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
