"""The harness's ports: one handed to a service is not handed to another process's service, and
a readiness poll answered by a stranger on the port is not taken for the service being ready."""
from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import textwrap

import pytest

from bench import fleet
from tests.procs import PYTHON, Proc, free_port


def test_a_port_another_process_reserved_is_skipped(monkeypatch):
    # Another process reserves a port and stays alive, as a second test worker would.
    holder = subprocess.Popen([PYTHON, "-c", textwrap.dedent("""
        import sys, time
        from bench.fleet import free_port
        print(free_port(), flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, cwd=fleet.REPO)
    try:
        held = int(holder.stdout.readline())
        # The kernel's bind(0) hands out the held port first (what it did in CI), then any.
        real_socket = socket.socket
        offers = [held]

        class Offering(real_socket):
            def bind(self, address):
                super().bind((address[0], offers.pop(0)) if offers and address[1] == 0 else address)

        monkeypatch.setattr(fleet.socket, "socket", Offering)
        port = fleet.free_port()
        assert port != held
        assert not offers, "the held port was offered and skipped"
    finally:
        holder.kill()
        holder.wait()


def test_a_port_is_free_again_for_others_once_its_holder_exits():
    first = subprocess.run([PYTHON, "-c", "from bench.fleet import free_port; print(free_port())"],
                           capture_output=True, text=True, cwd=fleet.REPO, check=True)
    port = int(first.stdout)
    fd = os.open(fleet.PORT_LOCKS / str(port), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the dead holder's lock lingered
    finally:
        os.close(fd)


def test_readiness_answered_by_a_stranger_on_the_port_is_an_error():
    port = free_port()
    stranger = Proc([PYTHON, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                    f"http://127.0.0.1:{port}/", name="stranger")
    with stranger:
        # A service that never listens: its readiness poll reaches the stranger.
        late = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(60)"], start_new_session=True)
        try:
            with pytest.raises(RuntimeError, match="outside the one started"):
                fleet.wait_http(f"http://127.0.0.1:{port}/", 10, late)
        finally:
            late.kill()
            late.wait()
        # The stranger itself passes the same check.
        fleet.wait_http(f"http://127.0.0.1:{port}/", 10, stranger.popen)
        assert fleet.listener_in_group(port, stranger.popen.pid) is True


def test_a_listener_busy_opening_and_closing_descriptors_is_still_its_own():
    # A starting lb opens and closes sockets while it probes its replicas; a descriptor closed
    # between listing /proc/PID/fd and reading it once made CI take lb's own port for a stranger's.
    port = free_port()
    busy = Proc([PYTHON, "-c", textwrap.dedent(f"""
        import http.server, os, threading
        def churn():
            while True:
                fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(64)]
                for fd in fds:
                    os.close(fd)
        threading.Thread(target=churn, daemon=True).start()
        http.server.HTTPServer(("127.0.0.1", {port}), http.server.SimpleHTTPRequestHandler).serve_forever()
    """)], f"http://127.0.0.1:{port}/", name="busy-listener")
    with busy:
        looks = [fleet.listener_in_group(port, os.getpgid(busy.popen.pid)) for _ in range(200)]
    assert looks.count(True) == len(looks), f"{looks.count(False)} of {len(looks)} looks said foreign"
