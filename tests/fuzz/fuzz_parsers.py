"""Coverage-guided fuzzing of the parsers that read bytes from the network before (or without) trusting them.

Three targets, each fed raw bytes as a hostile peer would send them:

* ``handshake``: both sides of the authentication handshake (``ferro.rendezvous.auth``), reading a peer's
  greeting, context, challenge, response and verdict.
* ``frame``: the compiled transport's receive path (``ferro._core.transport.Connection.recv_into``): frame
  headers (magic, version, kind, length, sequence, fingerprint), payloads and abort notices.
* ``store``: the store's request decoding and execution (``ferro.rendezvous.store``), as an authenticated but
  buggy or hostile client would send them.

The oracle: every input either parses or raises one of ferro's own errors (``DistributedError`` and its
kind); any other exception, a crash or a hang is a finding. Python code is instrumented by atheris; the
Cython core is not (it would need clang's libFuzzer instrumentation), so the frame target's mutations are
guided by the coverage of the Python around it, starting from a valid frame and an abort notice as seeds.

Usage (``pip install 'ferro[fuzz]'``)::

    python tests/fuzz/fuzz_parsers.py handshake -max_total_time=600        # ten minutes
    python tests/fuzz/fuzz_parsers.py frame -runs=200000 corpus/frame/     # a corpus directory of your own

Arguments after the target are libFuzzer's. ``tests/faults/test_fuzz.py`` runs each target briefly in CI.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import tempfile

import atheris

with atheris.instrument_imports(include=["ferro"]):
    from ferro._core.transport import KIND_ABORT, KIND_DATA, Connection, abort_payload
    from ferro.errors import DistributedError
    from ferro.rendezvous import auth
    from ferro.rendezvous.store import Store
    from ferro.rendezvous.store_wire import WAITING, pack, unpack

SECRET = b"fuzz-secret"
FINGERPRINT = 0x1234
LIMIT = 1 << 16  # bytes of input used: the socket pair's buffers hold them without blocking


def _peer_sends(data: bytes) -> tuple[socket.socket, socket.socket]:
    """A connected pair whose far end has already sent ``data`` and closed its side."""
    ours, theirs = socket.socketpair()
    theirs.sendall(data[:LIMIT])
    theirs.shutdown(socket.SHUT_WR)
    return ours, theirs


def fuzz_handshake(data: bytes) -> None:
    if not data:
        return
    ours, theirs = _peer_sends(data[1:])
    try:
        if data[0] & 1:
            auth.accept_handshake(ours, SECRET, 0.5, "fuzzed client")
        else:
            auth.connect_handshake(ours, SECRET, b"mesh|fuzz|2|1->0", 0.5, "fuzzed server")
    except DistributedError:
        pass  # refused: the expected end of nearly every input
    finally:
        ours.close()
        theirs.close()


def fuzz_frame(data: bytes) -> None:
    ours, theirs = _peer_sends(data)
    conn = Connection(ours, 0, 1, spin_us=0.0)
    try:
        conn.recv_into(bytearray(64), kind=KIND_DATA, fingerprint=FINGERPRINT, timeout=0.5)
    except DistributedError:
        pass
    finally:
        conn.close()
        theirs.close()


_owner: Store | None = None


def fuzz_store(data: bytes) -> None:
    """One fuzzed request over an authenticated connection: the server answers or drops it, and serves on."""
    global _owner
    if _owner is None:
        _owner = Store("127.0.0.1", 0, secret=SECRET, serve=True, timeout=5)
    message = data[:LIMIT]
    try:
        code, args = unpack(message)
        if code in WAITING and args:
            args[0] = args[0][:2]  # a get, wait or pop blocks up to this many milliseconds: keep the runs fast
        framed = pack(code, args)
    except ValueError:
        framed = len(message).to_bytes(4, "little") + message  # the server drops such a connection
    sock = socket.create_connection(("127.0.0.1", _owner.port), timeout=2)
    try:
        auth.connect_handshake(sock, SECRET, b"ferro-store", 2, "the store")
        sock.settimeout(0.5)
        sock.sendall(framed)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):
            pass
    except (OSError, DistributedError):
        pass
    finally:
        sock.close()
    _owner.set("alive", "yes", timeout=2)  # the server still serves
    assert _owner.get("alive", timeout=2) == b"yes"


TARGETS = {"handshake": fuzz_handshake, "frame": fuzz_frame, "store": fuzz_store}


def _seeds(target: str) -> str:
    """A corpus directory holding well-formed inputs for ``target``, to mutate from."""
    directory = tempfile.mkdtemp(prefix=f"ferro-fuzz-{target}-")
    seeds: list[bytes] = []
    if target == "frame":
        for kind, payload in ((KIND_DATA, b"x" * 64), (KIND_ABORT, abort_payload(1, 0, "seed"))):
            sender, receiver = socket.socketpair()
            conn = Connection(sender, 1, 0, spin_us=0.0)
            conn.send(payload, kind=kind, fingerprint=FINGERPRINT, timeout=1.0)
            seeds.append(receiver.recv(LIMIT))
            conn.close()
            receiver.close()
    elif target == "handshake":
        context = b"mesh|fuzz|2|1->0"
        seeds.append(b"\x01" + auth.MAGIC + b"\0" * auth.NONCE_BYTES + struct.pack("<H", len(context)) + context)
        seeds.append(b"\x00" + b"\0" * (auth.NONCE_BYTES + auth.MAC_BYTES) + auth.ACCEPTED)
    else:
        def request(code: int, *args: bytes) -> bytes:
            return bytes([code]) + b"".join(struct.pack("<I", len(a)) + a for a in args)

        seeds += [request(1, b"k", b"v"), request(2, b"10", b"k"), request(4, b"n", b"1"),
                  request(5, b"k", b"", b"v"), request(8)]
    for i, seed in enumerate(seeds):
        with open(os.path.join(directory, f"seed{i}"), "wb") as f:
            f.write(seed)
    return directory


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: {argv[0]} {{{','.join(TARGETS)}}} [libFuzzer options] [corpus directories]")
    target, options = argv[1], argv[2:]
    if not any(not option.startswith("-") for option in options):
        options.append(_seeds(target))  # no corpus given: start from the seeds
    atheris.Setup([argv[0], *options], TARGETS[target])
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
