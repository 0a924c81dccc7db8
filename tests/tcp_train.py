"""train.py, as a script that holds a TCP connection of its own through the run (an object-store,
tracker or metrics client does): it connects to DTGPT_TEST_TCP (host:port) before training, says
`hello <rank> <pid>`, trains, then says `bye <rank> <pid>` on the same connection and waits for
the server's `ok`. A recovery that shut the process's other sockets would make that fail.
Used by tests/faults/test_in_process.py."""

import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402  (the providers)
from dtgpt.cli import run_main  # noqa: E402


def say(connection: socket.socket, word: str) -> None:
    connection.sendall(f"{word} {os.environ['RANK']} {os.getpid()}\n".encode())


if __name__ == "__main__":
    host, port = os.environ["DTGPT_TEST_TCP"].rsplit(":", 1)
    connection = socket.create_connection((host, int(port)), timeout=60)
    say(connection, "hello")
    code = run_main(sys.argv[1:], train.model_provider, train.datasets_provider)
    say(connection, "bye")
    answer = connection.makefile().readline().strip()
    sys.exit(code if answer == "ok" else 3)
