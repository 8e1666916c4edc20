#pragma once
// OpenSSL 3's ABI as hetcomm's TLS uses it (tls.cc): its opaque types, the functions it calls,
// resolved at run time from libssl (never linked, its headers never included), and the socket
// BIO its sessions do their I/O through. Internal to tls.cc and nothing else.
#include <cstddef>
#include <cstdint>
#include <string>

// OpenSSL's opaque types (the struct tags of its typedefs).
struct ssl_ctx_st;
struct ssl_st;
struct ssl_method_st;
struct bio_st;
struct bio_method_st;
struct x509_st;
struct X509_name_st;

namespace hetcomm {
namespace tls {
namespace abi {

using SSL_CTX = ssl_ctx_st;
using SSL = ssl_st;
using SSL_METHOD = ssl_method_st;
using BIO = bio_st;
using BIO_METHOD = bio_method_st;
using X509 = x509_st;
using X509_NAME = X509_name_st;

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
  X(SSL_get0_peer_certificate, X509*, (const SSL*))                                 \
  X(SSL_CTX_get0_certificate, X509*, (const SSL_CTX*))                              \
  X(X509_check_host, int, (X509*, const char*, size_t, unsigned int, char**))       \
  X(X509_check_ip_asc, int, (X509*, const char*, unsigned int))                     \
  X(X509_get_subject_name, X509_NAME*, (const X509*))                               \
  X(X509_NAME_oneline, char*, (const X509_NAME*, char*, int))                       \
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

// Filled once by load(); read-only afterwards. Only used once load() said yes (a Context exists),
// so the I/O paths read it without synchronisation of their own: creating the Context happened
// before, through load()'s call_once.
extern OpenSsl gSsl;

// Loads OpenSSL 3 (dlopen of HETCOMM_TLS_LIBSSL, else libssl.so.3, else libssl.so) and resolves
// every function above, once per process (thread-safe; later calls only read). False, with *why
// (if given) saying why, when it cannot be used.
bool load(std::string* why);

}  // namespace abi
}  // namespace tls
}  // namespace hetcomm
