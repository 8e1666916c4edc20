#pragma once
// What the TLS tests share (test_tls.cc, test_tls_config.cc): the test PKI or a skip, a
// configuration and context from its files, and the message of a CommError.
#include <memory>
#include <string>

#include "check.h"
#include "common/error.h"
#include "tls_pki.h"
#include "transport/tls.h"

namespace tls_helpers {

inline const tls_pki::Pki& requirePki() {
  std::string why;
  if (!hetcomm::tls::available(&why)) SKIP_TEST("OpenSSL cannot be loaded: " + why);
  const tls_pki::Pki& pki = tls_pki::Pki::get();
  if (!pki.error().empty()) SKIP_TEST(pki.error());
  return pki;
}

inline hetcomm::tls::Config configOf(const tls_pki::Pki& pki, const std::string& leaf, const std::string& ca) {
  hetcomm::tls::Config c;
  c.mode = hetcomm::tls::Config::Mode::kAll;
  c.cert = pki.path(leaf + ".pem");
  c.key = pki.path(leaf + ".key");
  c.ca = pki.path(ca + ".pem");
  return c;
}

inline std::shared_ptr<hetcomm::tls::Context> contextOf(const tls_pki::Pki& pki, const std::string& leaf,
                                                        const std::string& ca) {
  return hetcomm::tls::Context::create(configOf(pki, leaf, ca));
}

// The message of what fn() throws (a CommError), or "(no error)".
template <typename Fn>
std::string errorOf(Fn fn) {
  try {
    fn();
  } catch (const hetcomm::CommError& e) {
    return e.what();
  }
  return "(no error)";
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace tls_helpers
