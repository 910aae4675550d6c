"""Certificates a test makes with the `openssl` CLI: one CA, server certificates for
127.0.0.1, client certificates; PEM files under a temporary directory."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl CLI makes the test certificates")


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@dataclass
class Pair:
    cert: str
    key: str


class CertAuthority:
    """A throwaway CA in `dir`; `issue` signs a leaf usable as a server (127.0.0.1) and a client."""

    def __init__(self, dir: Path, name: str = "lb-test-ca"):
        self.dir = dir
        dir.mkdir(parents=True, exist_ok=True)
        _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=dir)
        self.name = name
        self.cert = str(dir / f"{name}.pem")

    def issue(self, cn: str) -> Pair:
        d = self.dir
        (d / f"{cn}.ext").write_text("basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                     "extendedKeyUsage=serverAuth,clientAuth\nkeyUsage=digitalSignature\n"
                                     "authorityKeyIdentifier=keyid,issuer\nsubjectKeyIdentifier=hash\n")
        _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{cn}.key",
             "-out", f"{cn}.csr", "-subj", f"/CN={cn}", cwd=d)
        _run("x509", "-req", "-in", f"{cn}.csr", "-CA", f"{self.name}.pem", "-CAkey", f"{self.name}.key",
             "-CAcreateserial", "-days", "2", "-out", f"{cn}.pem", "-extfile", f"{cn}.ext", cwd=d)
        return Pair(str(d / f"{cn}.pem"), str(d / f"{cn}.key"))
