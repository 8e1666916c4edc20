// The TLS layer's setup, without a connection: what available() and Context::create say with no
// OpenSSL at all (in a child process, since the library is loaded once), the HETCOMM_TLS*
// settings, and credentials that cannot be used (the message names the files). Without OpenSSL
// or the openssl tool the tests that need them are skipped (exit code 77).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "check.h"
#include "common/error.h"
#include "tls_helpers.h"
#include "tls_pki.h"
#include "transport/tls.h"

using namespace hetcomm;
using namespace tls_helpers;
using tls_pki::Pki;

// (e), in a child process: what available() and Context::create say without OpenSSL.
// Does nothing in an ordinary run; availabilityWithoutOpenSsl runs it with HETCOMM_TLS_TEST_CHILD.
TEST_CASE(childReportsAvailability) {
  if (std::getenv("HETCOMM_TLS_TEST_CHILD") == nullptr) return;
  std::string why;
  const bool ok = tls::available(&why);
  std::printf("available=%d\nwhy=%s\n", ok ? 1 : 0, why.c_str());
  tls::Config config;
  config.mode = tls::Config::Mode::kAll;
  try {
    tls::Context::create(config);
    std::printf("create=ok\n");
  } catch (const tls::TlsError& e) {
    std::printf("create=%s\n", e.what());
  }
}

TEST_CASE(availabilityWithoutOpenSsl) {
  int out[2];
  REQUIRE(::pipe(out) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    ::setenv("HETCOMM_TLS_LIBSSL", "/nonexistent/libssl.so.3", 1);
    ::setenv("HETCOMM_TLS_TEST_CHILD", "1", 1);
    const char* argv[] = {"test_tls", "childReportsAvailability", nullptr};
    ::execv("/proc/self/exe", const_cast<char* const*>(argv));
    ::_exit(127);
  }
  ::close(out[1]);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof(buf))) != 0;) {
    if (n > 0) text.append(buf, static_cast<size_t>(n));
    if (n < 0 && errno != EINTR) break;
  }
  ::close(out[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, text);
  CHECK_MSG(contains(text, "available=0\n"), text);
  CHECK_MSG(contains(text, "why=dlopen(/nonexistent/libssl.so.3): "), text);
  CHECK_MSG(contains(text, "create=hetcomm: TLS requested (HETCOMM_TLS=all) but OpenSSL could not be loaded: dlopen("), text);
}

// (f) The settings: defaults, a bad mode, a missing file variable.
TEST_CASE(configFromEnvironment) {
  const char* vars[] = {"HETCOMM_TLS", "HETCOMM_TLS_CERT", "HETCOMM_TLS_KEY", "HETCOMM_TLS_CA", "HETCOMM_TLS_VERIFY_NAME"};
  for (const char* v : vars) ::unsetenv(v);
  CHECK(tls::configFromEnv().mode == tls::Config::Mode::kOff);

  ::setenv("HETCOMM_TLS", "yes", 1);
  std::string message = errorOf(tls::configFromEnv);
  CHECK_MSG(contains(message, "HETCOMM_TLS=yes is not one of all, inter-site, off"), message);

  ::setenv("HETCOMM_TLS", "inter-site", 1);
  ::setenv("HETCOMM_TLS_KEY", "/k.pem", 1);
  ::setenv("HETCOMM_TLS_CA", "/ca.pem", 1);
  message = errorOf(tls::configFromEnv);
  CHECK_MSG(contains(message, "HETCOMM_TLS=inter-site needs HETCOMM_TLS_CERT"), message);

  ::setenv("HETCOMM_TLS_CERT", "/c.pem", 1);
  const tls::Config c = tls::configFromEnv();
  CHECK(c.mode == tls::Config::Mode::kInterSite);
  CHECK(c.cert == "/c.pem" && c.key == "/k.pem" && c.ca == "/ca.pem");
  ::setenv("HETCOMM_TLS", "all", 1);
  CHECK(tls::configFromEnv().mode == tls::Config::Mode::kAll);
  CHECK(!tls::configFromEnv().verifyHost);
  ::setenv("HETCOMM_TLS_VERIFY_NAME", "host", 1);
  CHECK(tls::configFromEnv().verifyHost);
  ::setenv("HETCOMM_TLS_VERIFY_NAME", "rank", 1);
  message = errorOf(tls::configFromEnv);
  CHECK_MSG(contains(message, "HETCOMM_TLS_VERIFY_NAME=rank is not one of host, off"), message);
  ::setenv("HETCOMM_TLS_VERIFY_NAME", "host", 1);
  ::setenv("HETCOMM_TLS", "off", 1);
  message = errorOf(tls::configFromEnv);  // a check asked for must not silently do nothing
  CHECK_MSG(contains(message, "HETCOMM_TLS_VERIFY_NAME=host") && contains(message, "HETCOMM_TLS is off"), message);
  ::unsetenv("HETCOMM_TLS_VERIFY_NAME");
  CHECK(tls::configFromEnv().mode == tls::Config::Mode::kOff);
  for (const char* v : vars) ::unsetenv(v);
}

// (g) Credentials that cannot be used: the message names the files.
TEST_CASE(unusableCredentialsNameTheFiles) {
  const Pki& pki = requirePki();
  auto failure = [](const tls::Config& config) { return errorOf([&] { tls::Context::create(config); }); };
  tls::Config mismatched = configOf(pki, "a", "caA");
  mismatched.key = pki.path("b.key");
  std::string message = failure(mismatched);
  CHECK_MSG(contains(message, "HETCOMM_TLS_KEY=" + pki.path("b.key")), message);
  CHECK_MSG(contains(message, "HETCOMM_TLS_CERT=" + pki.path("a.pem")), message);
  CHECK_MSG(contains(message, "key values mismatch"), message);
  std::printf("  %s\n", message.c_str());

  tls::Config missing = configOf(pki, "a", "caA");
  missing.cert = pki.path("missing.pem");
  message = failure(missing);
  CHECK_MSG(contains(message, "cannot read HETCOMM_TLS_CERT=" + missing.cert + ": No such file or directory"), message);

  tls::Config notPem = configOf(pki, "a", "caA");
  notPem.ca = pki.path("openssl.log");  // a readable file without a certificate in it
  message = failure(notPem);
  CHECK_MSG(contains(message, "cannot load the CA certificates HETCOMM_TLS_CA=" + notPem.ca), message);

  tls::Config keyAsCert = configOf(pki, "a", "caA");
  keyAsCert.cert = pki.path("a.key");
  message = failure(keyAsCert);
  CHECK_MSG(contains(message, "cannot load the certificate chain HETCOMM_TLS_CERT=" + keyAsCert.cert), message);
}

