"""A minimal SFTP service for the cluster's storage host: one ``sftp-server`` per TCP connection.

sshfs mounts it with ``-o directport=PORT`` (SFTP straight over TCP, no ssh): the cluster's shared
file system is then sshfs's FUSE client on every node talking to OpenSSH's own ``sftp-server`` on
the storage host, over the bridge, through the storage link's ``tc tbf`` cap. No sshd, no keys and
no encryption (the bridge reaches only namespaces the harness made).

    python3 sftpd.py --listen 10.99.13.2 --port 7022 --root /export [--sftp-server PATH]

Runs in the foreground until SIGTERM; each connection's server is a child process that dies with
its connection.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys

SFTP_SERVERS = ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server", "/usr/libexec/sftp-server")


def find_sftp_server() -> str:
    for path in SFTP_SERVERS:
        if os.access(path, os.X_OK):
            return path
    raise SystemExit(f"sftpd: no sftp-server in {', '.join(SFTP_SERVERS)}; install openssh-sftp-server")


def serve(listen: str, port: int, root: str, server: str) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as ls:
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((listen, port))
        ls.listen(64)
        while True:
            conn, _ = ls.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if os.fork() == 0:
                ls.close()
                os.dup2(conn.fileno(), 0)
                os.dup2(conn.fileno(), 1)
                conn.close()
                os.chdir(root)
                os.execv(server, [server, "-e", "-d", root])
            conn.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, help="address to listen on (the storage host's)")
    p.add_argument("--port", type=int, default=7022)
    p.add_argument("--root", required=True, help="directory served (sftp-server's start directory)")
    p.add_argument("--sftp-server", default=None, help="path of OpenSSH's sftp-server")
    a = p.parse_args(argv)
    serve(a.listen, a.port, os.path.abspath(a.root), a.sftp_server or find_sftp_server())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
