"""A real Kubernetes API server for tests: ``etcd`` and ``kube-apiserver`` started as processes
(what controller-runtime's envtest does), with a kubeconfig that reaches it.

The binaries are looked up, in order, in ``$KUBEBUILDER_ASSETS`` (the folder ``setup-envtest use``
prints), ``/usr/local/kubebuilder/bin`` (envtest's default) and ``PATH``; :func:`find_binaries`
returns ``None`` when either is missing, and the fixtures skip, saying so. There is no
kube-controller-manager and no scheduler: objects are stored and validated, CRDs are served,
server-side apply, status subresources and watches work, but no Deployment gets pods and
ownerReferences are not garbage-collected.

The server authenticates a static bearer token (``--token-auth-file``, user ``kvfleet-test`` in
``system:masters``), allows everything (``--authorization-mode=AlwaysAllow``) and serves TLS with
a self-signed certificate it makes itself (the kubeconfig skips verification). etcd and the API
server listen on 127.0.0.1 only, on free ports, with their data under the given folder.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

#: where envtest (controller-runtime) puts its binaries by default.
ENVTEST_DEFAULT = Path("/usr/local/kubebuilder/bin")


def find_binaries() -> tuple[Path, Path] | None:
    """``(etcd, kube-apiserver)`` from ``$KUBEBUILDER_ASSETS``, envtest's default folder or ``PATH``."""
    folders = [Path(p) for p in (os.environ.get("KUBEBUILDER_ASSETS"), str(ENVTEST_DEFAULT)) if p]

    def find(name: str) -> Path | None:
        for f in folders:
            if (f / name).is_file() and os.access(f / name, os.X_OK):
                return f / name
        found = shutil.which(name)
        return Path(found) if found else None

    etcd, apiserver = find("etcd"), find("kube-apiserver")
    return (etcd, apiserver) if etcd and apiserver else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rsa_key_pem() -> tuple[bytes, bytes]:
    """A fresh RSA key pair (private, public) in PEM: the service-account token signing key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public


class LocalAPIServer:
    """etcd + kube-apiserver under ``workdir``; a context manager.

    Attributes:
        url: ``https://127.0.0.1:PORT``.
        token: the bearer token of the admin user.
        kubeconfig: path of a kubeconfig for the server (``KUBECONFIG``).
        version: the server's ``gitVersion`` once started.
    """

    def __init__(self, workdir: Path, etcd: Path, apiserver: Path) -> None:
        self.workdir, self.etcd_bin, self.apiserver_bin = Path(workdir), etcd, apiserver
        self.token = secrets.token_hex(16)
        self.etcd_port, self.peer_port, self.port = _free_port(), _free_port(), _free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.kubeconfig = self.workdir / "kubeconfig"
        self.version = ""
        self._procs: list[subprocess.Popen] = []

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self._procs.append(proc)
        return proc

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last ``lines`` lines of ``etcd.log`` or ``kube-apiserver.log``."""
        try:
            return "\n".join((self.workdir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start(self, timeout_s: float = 120.0) -> LocalAPIServer:
        """Start etcd, then the API server, and wait until ``/readyz`` answers 200.

        Raises:
            RuntimeError: a process exited or the server was not ready in ``timeout_s`` (with the
                end of its log).
        """
        w = self.workdir
        w.mkdir(parents=True, exist_ok=True)
        etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        self._spawn("etcd", [str(self.etcd_bin), "--name", "default", "--data-dir", str(w / "etcd"),
                             "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                             "--initial-cluster", f"default={peer_url}", "--log-level", "warn"])
        private, public = _rsa_key_pem()
        (w / "sa.key").write_bytes(private)
        (w / "sa.pub").write_bytes(public)
        (w / "tokens.csv").write_text(f'{self.token},kvfleet-test,kvfleet-test,"system:masters"\n')
        (w / "certs").mkdir(exist_ok=True)
        self._spawn("kube-apiserver", [
            str(self.apiserver_bin), f"--etcd-servers={etcd_url}", f"--secure-port={self.port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--cert-dir={w / 'certs'}",
            f"--token-auth-file={w / 'tokens.csv'}", "--authorization-mode=AlwaysAllow",
            f"--service-account-key-file={w / 'sa.pub'}", f"--service-account-signing-key-file={w / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=true",
            # no controller-manager makes default ServiceAccounts: do not require them
            "--disable-admission-plugins=ServiceAccount"])
        self._write_kubeconfig()
        deadline = time.monotonic() + timeout_s
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        while True:
            for proc, name in zip(self._procs, ("etcd", "kube-apiserver")):
                if proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.log_tail(name)}")
            try:
                req = urllib.request.Request(f"{self.url}/readyz", headers={"Authorization": f"Bearer {self.token}"})
                with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                tail = self.log_tail("kube-apiserver")
                raise RuntimeError(f"kube-apiserver not ready after {timeout_s:g} s:\n{tail}")
            time.sleep(0.5)
        req = urllib.request.Request(f"{self.url}/version", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
            self.version = json.load(r).get("gitVersion", "")
        return self

    def _write_kubeconfig(self) -> None:
        import yaml

        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "local",
            "clusters": [{"name": "local", "cluster": {"server": self.url, "insecure-skip-tls-verify": True}}],
            "users": [{"name": "kvfleet-test", "user": {"token": self.token}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "kvfleet-test"}}]}))

    def api_client(self):
        """A ``kubernetes.client.ApiClient`` for the server."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def stop(self) -> None:
        """Stop the API server, then etcd (SIGTERM, then SIGKILL after 10 s)."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._procs.clear()

    def __enter__(self) -> LocalAPIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
