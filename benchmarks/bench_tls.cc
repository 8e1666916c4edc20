// Throughput of one TCP connection on loopback, plain ::send/::recv beside TLS 1.3
// (TCP and TLS links, transport/link.h), one way: a sender thread and a receiver thread, each on its own
// core, moving N bytes in writes and reads of B bytes through non-blocking sockets tuned as
// hetcomm tunes them, alternating plain and TLS runs. Prints JSON Lines (benchmarks/README.md,
// "Result files"): a `run` header, then a `result` per run with the wall time, GB/s and the CPU
// seconds per GB of each thread (getrusage(RUSAGE_THREAD)): the per-core cost of the encryption
// and decryption. TLS uses OpenSSL's default TLS 1.3 suite (TLS_AES_256_GCM_SHA384).
//
//   cmake --build build-tls   # the torch-free hetcomm_base
//   g++ -O2 -std=c++17 -Icsrc -Itests/cpp benchmarks/bench_tls.cc build-tls/libhetcomm_base.a -lpthread -ldl -o /tmp/bench_tls
//   /tmp/bench_tls [GB=1] [chunk KB=1024] [repeats=3] > benchmarks/results/tls_loopback_2core_vm.json
#include <sched.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tls_pki.h"
#include "transport/link.h"
#include "transport/socket.h"
#include "transport/tls.h"

using namespace hetcomm;

namespace {

double threadCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_THREAD, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

void pinTo(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu % static_cast<int>(std::thread::hardware_concurrency()), &set);
  sched_setaffinity(0, sizeof(set), &set);
}

// Moves `total` bytes one way in chunks; returns the thread's CPU seconds.
double transfer(Link& link, bool sending, size_t total, size_t chunk) {
  std::vector<char> buf(chunk, 'x');
  const double cpu0 = threadCpuSeconds();
  size_t done = 0, offer = 0;
  while (done < total) {
    ssize_t n;
    if (sending) {
      if (offer == 0) offer = std::min(chunk, total - done);  // kept after EAGAIN (TLS retry rule)
      n = link.send(buf.data(), offer);
    } else {
      n = link.recv(buf.data(), std::min(chunk, total - done));
    }
    if (n > 0) {
      done += static_cast<size_t>(n);
      offer = 0;
      continue;
    }
    if (n == 0 || errno != EAGAIN) throw std::runtime_error(std::string("I/O failed: ") + std::strerror(errno));
    LinkWait w{&link, sending, !sending};
    waitLinks(&w, 1, std::chrono::seconds(1));
  }
  return threadCpuSeconds() - cpu0;
}

std::string cpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

}  // namespace

int main(int argc, char** argv) {
  const double gb = argc > 1 ? std::atof(argv[1]) : 1.0;
  const size_t chunk = (argc > 2 ? std::atoi(argv[2]) : 1024) * size_t{1024};
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 3;
  const size_t total = static_cast<size_t>(gb * 1e9);
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i > 0 ? " " : "") + std::string(argv[i]);
  std::string why;
  const bool haveTls = tls::available(&why);
  if (!haveTls) std::fprintf(stderr, "TLS not measured: %s\n", why.c_str());
  const tls_pki::Pki& pki = tls_pki::Pki::get();
  std::printf("{\"kind\": \"run\", \"command\": \"%s\", \"benchmark\": \"tls_loopback\", \"bytes\": %zu, "
              "\"chunk\": %zu, \"cpu\": \"%s\", \"cores\": %u, \"tls\": \"%s\"}\n",
              command.c_str(), total, chunk, cpuModel().c_str(), std::thread::hardware_concurrency(),
              haveTls ? "TLS 1.3, OpenSSL's default suite" : why.c_str());
  for (int run = 0; run < 2 * repeats; ++run) {
    const bool encrypted = run % 2 == 1;
    if (encrypted && (!haveTls || !pki.error().empty())) continue;
    Socket listener = listenOn("127.0.0.1", 0);
    Socket client = connectTo(boundAddress(listener.fd()), Clock::now() + std::chrono::seconds(10));
    pollfd p{listener.fd(), POLLIN, 0};
    ::poll(&p, 1, 10000);
    Socket server(::accept4(listener.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    std::unique_ptr<Link> serverLink, clientLink;
    if (encrypted) {
      tls::Config c;
      c.mode = tls::Config::Mode::kAll;
      c.cert = pki.path("a.pem");
      c.key = pki.path("a.key");
      c.ca = pki.path("caA.pem");
      auto context = tls::Context::create(c);
      const Deadline deadline = Clock::now() + std::chrono::seconds(10);
      std::unique_ptr<tls::Session> serverSession;
      std::thread t([&] { serverSession = tls::Session::handshake(*context, server.fd(), true, deadline, {}, [] { return std::string("client"); }); });
      std::unique_ptr<tls::Session> clientSession =
          tls::Session::handshake(*context, client.fd(), false, deadline, {}, [] { return std::string("server"); });
      t.join();
      serverLink = tlsLink(std::move(server), std::move(serverSession));
      clientLink = tlsLink(std::move(client), std::move(clientSession));
    } else {
      serverLink = tcpLink(std::move(server));
      clientLink = tcpLink(std::move(client));
    }
    double sendCpu = 0, recvCpu = 0;
    const auto start = Clock::now();
    std::thread receiver([&] {
      pinTo(1);
      recvCpu = transfer(*serverLink, false, total, chunk);
    });
    pinTo(0);
    sendCpu = transfer(*clientLink, true, total, chunk);
    receiver.join();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf("{\"kind\": \"result\", \"transport\": \"%s\", \"repeat\": %d, \"seconds\": %.3f, \"GBps\": %.3f, "
                "\"sender_cpu_s_per_GB\": %.3f, \"receiver_cpu_s_per_GB\": %.3f}\n",
                encrypted ? "tls1.3" : "plain", run / 2, seconds, total / seconds / 1e9, sendCpu / (total / 1e9),
                recvCpu / (total / 1e9));
    std::fflush(stdout);
  }
  return 0;
}
