"""hetcomm.bench.nic: the peak rate over a window, by hand; the counters of this namespace."""
from __future__ import annotations

import socket
import time

from hetcomm.bench.nic import NicSampler, bytes_sent, peak_rate


def test_peak_rate_by_hand():
    samples = [(0.0, 0), (0.5, 0), (1.0, 100), (1.5, 100), (2.0, 100), (2.5, 400), (3.0, 400)]
    # windows of 1 s from each sample: 100, 100, 0, 300, 300 bytes
    assert peak_rate(samples) == 300.0
    assert peak_rate(samples, window=2.0) == 200.0              # [0.5, 2.5]: 400 bytes in 2 s
    assert peak_rate(samples, end=2.0) == 100.0                 # the burst at 2.5 s left out
    assert peak_rate(samples, start=1.5) == 300.0
    assert peak_rate(samples, window=5.0) is None               # the samples span 3 s
    # uneven spacing: the first sample at least 1 s later, over the time between them
    assert abs(peak_rate([(0.0, 0), (0.4, 10), (1.6, 130)]) - 100.0) < 1e-9   # 120 B in 1.2 s (from 0: 130 / 1.6)


def test_the_counters_of_this_namespace_do_not_count_loopback(tmp_path):
    dev = tmp_path / "dev"
    dev.write_text("Inter-|   Receive |  Transmit\n face |bytes packets|bytes packets\n"
                   "    lo: 5000 1 0 0 0 0 0 0 7000 1 0 0 0 0 0 0\n"
                   "  eth0: 100 1 0 0 0 0 0 0 250 3 0 0 0 0 0 0\n"
                   " veth1: 0 0 0 0 0 0 0 0 50 1 0 0 0 0 0 0\n")
    assert bytes_sent(str(dev)) == 300
    sampler = NicSampler(interval=0.01).start()
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    with server, a, b:                            # 8 MB over loopback TCP: not counted
        payload = b"x" * (1 << 20)
        for _ in range(8):
            a.sendall(payload)
            got = 0
            while got < len(payload):
                got += len(b.recv(1 << 20))
    time.sleep(0.05)
    samples = sampler.stop()
    assert len(samples) >= 2 and samples[0][1] == 0
    assert all(x[0] <= y[0] for x, y in zip(samples, samples[1:]))
    assert samples[-1][1] < (4 << 20), samples[-1]   # (other traffic of the machine: far below)
