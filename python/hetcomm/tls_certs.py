"""Throwaway certificates for trying HETCOMM_TLS, for the tests and the benchmarks:

    python -m hetcomm.tls_certs DIR [--names rank0 ...] [--hosts NAME=HOST[,HOST...] ...] [--rogue]

makes in DIR a CA (``ca.pem``, ``ca.key``) and, for each name, a key and a certificate it signed
(``NAME.key``, ``NAME.pem``), whose subjectAltName lists the hosts ``--hosts`` gives that name (for
``HETCOMM_TLS_VERIFY_NAME=host``: the IP addresses its ranks listen on, since ranks publish
addresses, not names; a DNS name is written as such); with ``--rogue`` also a second, unrelated CA and a leaf it signed
(``rogue.pem``, ``rogue.key``), which hetcomm must refuse. EC P-256 keys, valid for 30 days, made
with the ``openssl`` command-line tool. A real cluster's certificates come from its own CA and
its usual tooling: this is a quick start, not a PKI.

Then, on every rank: ``HETCOMM_TLS=all`` (or ``inter-site``), ``HETCOMM_TLS_CA=DIR/ca.pem``,
``HETCOMM_TLS_CERT=DIR/NAME.pem``, ``HETCOMM_TLS_KEY=DIR/NAME.key``.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import subprocess
import sys
from typing import Mapping, Sequence

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(args: Sequence[str], cwd: str) -> None:
    if shutil.which("openssl") is None:
        raise RuntimeError("hetcomm.tls_certs: the openssl command-line tool is not installed")
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"hetcomm.tls_certs: openssl {' '.join(args[:2])} failed: {proc.stderr.strip()[-500:]}")


def _ca(directory: str, name: str) -> None:
    _openssl(["req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "30",
              "-subj", f"/CN=hetcomm-{name}"], directory)


def _alt_name(host: str) -> str:
    address = host.split("%", 1)[0]  # an IPv6 zone ("fe80::1%eth0") is no part of the address
    try:
        ipaddress.ip_address(address)
        return f"IP:{address}"
    except ValueError:
        return f"DNS:{host}"


def _leaf(directory: str, name: str, ca: str, hosts: Sequence[str] = ()) -> None:
    _openssl(["req", "-new", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}"], directory)
    extensions = []
    if hosts:  # an extension file: -copy_extensions needs the openssl tool of OpenSSL 3
        with open(os.path.join(directory, f"{name}.ext"), "w") as f:
            f.write("subjectAltName=" + ",".join(_alt_name(h) for h in hosts) + "\n")
        extensions = ["-extfile", f"{name}.ext"]
    _openssl(["x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
              *extensions, "-out", f"{name}.pem", "-days", "30"], directory)
    for leftover in (f"{name}.csr", f"{name}.ext"):
        if os.path.exists(os.path.join(directory, leftover)):
            os.remove(os.path.join(directory, leftover))


def make(directory: str, names: Sequence[str] = ("node",), rogue: bool = False,
         hosts: Mapping[str, Sequence[str]] | None = None) -> dict[str, str]:
    """Makes the files (see the module's docstring); returns {name: certificate path}.
    ``hosts``: for some names, the hosts their certificate names (subjectAltName)."""
    os.makedirs(directory, exist_ok=True)
    _ca(directory, "ca")
    for name in names:
        _leaf(directory, name, "ca", (hosts or {}).get(name, ()))
    if rogue:
        _ca(directory, "rogue-ca")
        _leaf(directory, "rogue", "rogue-ca")
    return {name: os.path.join(directory, f"{name}.pem") for name in [*names, *(["rogue"] if rogue else [])]}


def env_for(directory: str, name: str, mode: str = "all") -> dict[str, str]:
    """The HETCOMM_TLS* settings of a process that presents certificate ``name``."""
    return {"HETCOMM_TLS": mode, "HETCOMM_TLS_CA": os.path.join(directory, "ca.pem"),
            "HETCOMM_TLS_CERT": os.path.join(directory, f"{name}.pem"),
            "HETCOMM_TLS_KEY": os.path.join(directory, f"{name}.key")}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--names", nargs="+", default=["node"])
    ap.add_argument("--hosts", nargs="+", default=[], metavar="NAME=HOST[,HOST...]",
                    help="the hosts a name's certificate names (for HETCOMM_TLS_VERIFY_NAME=host)")
    ap.add_argument("--rogue", action="store_true")
    args = ap.parse_args(argv)
    hosts = {}
    for item in args.hosts:
        name, _, listed = item.partition("=")
        entries = [h for h in listed.split(",") if h]
        if name not in args.names or not entries or name in hosts:
            ap.error(f"--hosts {item}: give NAME=HOST[,HOST...] once for each of --names that needs it")
        hosts[name] = entries
    for name, path in make(args.directory, args.names, args.rogue, hosts).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
