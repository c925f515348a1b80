"""What the interop scripts' gloo ranks share: a port for their rendezvous,
and how a rank leaves."""
import os
import socket
import sys


def free_port():
    """A TCP port free now, for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave(code=0):
    """Ends a rank's process without the interpreter's teardown, where gloo's
    threads sometimes abort ("terminate called without an active exception")
    after the work is done."""
    sys.stdout.flush()
    os._exit(code)
