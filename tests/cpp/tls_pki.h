#pragma once
// Throwaway certificates for the TLS tests and benchmark, made with the `openssl` command line
// tool in a fresh temporary folder (removed at exit):
//   caA.pem/.key  a CA;                 a.pem/.key, b.pem/.key  leaves it signed (rank-a, rank-b)
//   caB.pem/.key  another, unrelated CA; c.pem/.key             a leaf it signed (rank-c)
//   d.pem/.key    a leaf of caA (CN rank-d) whose subjectAltName names node-d.example,
//                 *.rack7.example, 127.0.0.1 and ::1 (-extfile: also the openssl tool of 1.1.1)
// EC P-256 keys: generating them takes milliseconds, RSA keys a second each.
#include <stdlib.h>

#include <cstdio>
#include <string>

namespace tls_pki {

class Pki {
 public:
  // The set of this process, made on first use; error() says why there is none.
  static const Pki& get() {
    static const Pki pki;
    return pki;
  }
  const std::string& error() const { return error_; }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  Pki() {
    if (std::system("command -v openssl > /dev/null 2>&1") != 0) {
      error_ = "the openssl command line tool is not installed";
      return;
    }
    char tmpl[] = "/tmp/hetcomm-tls-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      error_ = "mkdtemp failed";
      return;
    }
    dir_ = tmpl;
    const std::string ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    std::string script = "cd " + dir_ + " && (set -e";
    for (const char* ca : {"caA", "caB"}) {
      script += std::string(" ; openssl req -x509") + ec + " -keyout " + ca + ".key -out " + ca +
                ".pem -days 2 -subj /CN=hetcomm-test-" + ca;
    }
    for (const char* leaf : {"a:caA", "b:caA", "c:caB"}) {
      const std::string name(leaf, 1), ca(leaf + 2);
      script += " ; openssl req -new" + ec + " -keyout " + name + ".key -out " + name + ".csr -subj /CN=rank-" + name +
                " ; openssl x509 -req -in " + name + ".csr -CA " + ca + ".pem -CAkey " + ca + ".key -CAcreateserial -out " +
                name + ".pem -days 2";
    }
    script += std::string(" ; echo 'subjectAltName=DNS:node-d.example,DNS:*.rack7.example,IP:127.0.0.1,IP:::1' > d.ext") +
              " ; openssl req -new" + ec + " -keyout d.key -out d.csr -subj /CN=rank-d" +
              " ; openssl x509 -req -in d.csr -CA caA.pem -CAkey caA.key -CAcreateserial -extfile d.ext" +
              " -out d.pem -days 2";
    script += ") > openssl.log 2>&1";
    if (std::system(script.c_str()) != 0) error_ = "making test certificates failed (see " + dir_ + "/openssl.log)";
  }
  ~Pki() {
    if (!dir_.empty() && error_.empty()) (void)!std::system(("rm -rf " + dir_).c_str());
  }

  std::string dir_;
  std::string error_;
};

}  // namespace tls_pki
