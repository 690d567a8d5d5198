"""The rendezvous store: torch TCPStore semantics, timeouts, authentication."""

import logging
import threading

import pytest
from _sync import on_entering, wait_until_inside

import ferro
from ferro.rendezvous.store import MAX_MESSAGE_BYTES, Store

SECRET = b"store-test-secret"


@pytest.fixture
def store():
    with Store("127.0.0.1", 0, secret=SECRET, serve=True, timeout=10) as s:
        yield s


def client(store, secret=SECRET, timeout=10):
    return Store("127.0.0.1", store.port, secret=secret, timeout=timeout)


def test_set_get_between_clients(store):
    with client(store) as other:
        store.set("key", b"value")
        other.set("text", "héllo")
        assert other.get("key") == b"value"
        assert store.get("text") == "héllo".encode()


def test_get_waits_for_a_later_set(store):
    with client(store) as other:
        on_entering("_read_message", lambda: other.set("late", b"1"))  # once the get is waiting
        assert store.get("late", timeout=10) == b"1"


def test_get_times_out_naming_the_key(store):
    with pytest.raises(ferro.DistributedTimeoutError, match="'missing'"):
        store.get("missing", timeout=0.1)
    store.set("after", b"ok")  # the client is still usable
    assert store.get("after") == b"ok"


def test_wait_names_the_keys_still_missing(store):
    store.set("a", b"")
    with pytest.raises(ferro.DistributedTimeoutError, match="'b', 'c'"):
        store.wait(["a", "b", "c"], timeout=0.1)
    store.set("b", b"")
    store.set("c", b"")
    store.wait(["a", "b", "c"], timeout=1)


def test_add_counts_atomically_across_clients(store):
    clients = [client(store) for _ in range(4)]

    def bump(c):
        for _ in range(50):
            c.add("counter", 1)

    threads = [threading.Thread(target=bump, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert store.add("counter", 0) == 200
    assert store.get("counter") == b"200"
    assert store.add("fresh", -3) == -3
    for c in clients:
        c.close()


def test_add_on_a_non_integer_is_a_store_error(store):
    store.set("word", b"hello")
    with pytest.raises(ferro.StoreError, match="not an integer"):
        store.add("word", 1)


def test_compare_set_follows_torch_semantics(store):
    assert store.compare_set("k", b"", b"first") == b"first"  # missing key, empty expectation: set
    assert store.compare_set("k", b"wrong", b"second") == b"first"  # mismatch: current value returned
    assert store.compare_set("k", b"first", b"second") == b"second"
    assert store.compare_set("absent", b"x", b"y") == b"x"  # missing key, non-empty expectation
    assert not store.check(["absent"])


def test_delete_check_and_num_keys(store):
    store.set("x", b"1")
    store.set("y", b"2")
    assert store.check(["x", "y"]) and not store.check(["x", "z"])
    assert store.num_keys() == 2
    assert store.delete_key("x") is True
    assert store.delete_key("x") is False
    assert store.num_keys() == 1


def test_client_started_before_the_server_connects_with_backoff():
    from ferro.rendezvous.settings import free_port

    port = free_port()
    servers = []

    class StartServerAfterAFailedAttempt(logging.Handler):
        def emit(self, record):
            if "retrying" in record.getMessage() and not servers:
                servers.append(ferro.StoreServer("127.0.0.1", port, secret=SECRET))

    log = logging.getLogger("ferro.rendezvous")
    handler, level = StartServerAfterAFailedAttempt(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        with Store("127.0.0.1", port, secret=SECRET, timeout=10) as late:
            late.set("k", b"v")
            assert late.get("k") == b"v"
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert len(servers) == 1  # the client really did start first and retry
    servers[0].close()


def test_unreachable_store_times_out_with_advice():
    from ferro.rendezvous.settings import free_port

    with pytest.raises(ferro.DistributedTimeoutError, match="MASTER_ADDR and MASTER_PORT"):
        Store("127.0.0.1", free_port(), secret=SECRET, timeout=0.3)


def test_client_without_the_secret_is_refused_and_the_store_keeps_serving(store):
    with pytest.raises(ferro.AuthenticationError, match="secret"):
        client(store, secret=b"guess")
    with client(store) as good:
        good.set("still", b"here")
        assert store.get("still") == b"here"


def test_lost_server_is_peer_lost(store):
    with Store("127.0.0.1", 0, secret=SECRET, serve=True, timeout=10) as owner:
        other = client(owner)
        owner.close()
        with pytest.raises(ferro.PeerLostError, match="store"):
            other.get("k", timeout=5)
        other.close()


def test_server_shutdown_wakes_a_blocked_get():
    owner = Store("127.0.0.1", 0, secret=SECRET, serve=True, timeout=30)
    waiter = client(owner, timeout=30)
    errors = []

    def blocked_get():
        try:
            waiter.get("never", timeout=30)
        except ferro.DistributedError as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked_get)
    thread.start()
    wait_until_inside(thread, "_read_message")  # the request was sent; the answer is awaited
    owner.close()
    thread.join(10)
    assert not thread.is_alive() and len(errors) == 1
    waiter.close()


def test_oversized_value_is_refused_without_breaking_the_server(store):
    with client(store) as big:
        with pytest.raises(ferro.PeerLostError):
            big.set("huge", b"x" * (MAX_MESSAGE_BYTES + 1))
    store.set("small", b"ok")
    assert store.get("small") == b"ok"


def test_closed_client_raises_closed(store):
    c = client(store)
    c.close()
    with pytest.raises(ferro.BackendClosedError):
        c.set("k", b"v")


def test_admission_accepts_nothing_until_started():
    """A client already in the backlog is handed over only after start().

    The handler reaches the Admission through its owner (to call settled); CI once
    saw a store thread die on ``'StoreServer' object has no attribute '_admission'``
    when a queued connection was accepted inside the constructor.
    """
    import socket

    from ferro.rendezvous.auth import Admission, RefusalLog

    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname()[:2], timeout=5)
    handled = threading.Event()
    owner: dict[str, Admission] = {}

    def handle(sock: socket.socket, address: tuple[str, int]) -> None:
        handled.set()
        owner["admission"].settled(sock)
        sock.close()

    admission = Admission(listener, handle, RefusalLog(logging.getLogger("test"), "test"), "test-admission")
    try:
        assert not handled.wait(0.3)  # queued, but not accepted before start()
        owner["admission"] = admission
        admission.start()
        assert handled.wait(10)
        assert admission.unsettled == 0
    finally:
        admission.stop()
        listener.close()
        client.close()


def test_free_port_draws_bindable_ports_outside_the_kernels_outgoing_range(monkeypatch):
    import socket

    from ferro.rendezvous import settings

    ephemeral = settings._ephemeral_ports()
    ports = {settings.free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn, not one fixed port every rank and run would share
    for port in ports:
        assert port in settings.LISTEN_PORTS and port not in ephemeral
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))
    # Nothing free in the drawn range: the kernel's choice instead of a failure.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        held = holder.getsockname()[1]
        monkeypatch.setattr(settings, "LISTEN_PORTS", range(held, held + 1))
        monkeypatch.setattr(settings, "_ephemeral_ports", lambda: range(0))
        fallback = settings.free_port()
        assert fallback != held
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", fallback))


def test_batched_operations_follow_torch_semantics(store):
    with client(store) as other:
        store.multi_set(["a", "b"], [b"1", "two"])
        assert other.multi_get(["b", "a"]) == [b"two", b"1"]
        other.append("log", "x")
        other.append("log", b"yz")
        assert store.get("log") == b"xyz"
        with pytest.raises(ferro.StoreKeyTimeoutError) as missing:
            other.multi_get(["a", "never"], timeout=0.3)
        assert missing.value.missing == ("never",)
        with pytest.raises(ValueError, match="2 keys but 1 values"):
            store.multi_set(["a", "b"], [b"1"])


def test_queue_pop_waits_for_a_push_and_serves_waiters_in_order(store):
    popped = []
    waiters = [client(store) for _ in range(3)]

    def pop(i):
        popped.append((i, waiters[i].queue_pop("jobs", timeout=10)))

    threads = []
    for i in range(3):
        threads.append(threading.Thread(target=pop, args=(i,)))
        threads[-1].start()
        wait_until_inside(threads[-1], "_read_message")  # each asks before the next: their order is known
    assert store.queue_len("jobs") == 0
    for item in (b"first", b"second", b"third"):
        store.queue_push("jobs", item)
    for thread in threads:
        thread.join(10)
    assert sorted(popped) == [(0, b"first"), (1, b"second"), (2, b"third")]
    store.queue_push("jobs", "left")
    assert store.queue_len("jobs") == 1 and not store.check(["jobs"])  # queues live apart from keys
    with pytest.raises(ferro.StoreKeyTimeoutError, match="queue 'empty'"):
        store.queue_pop("empty", timeout=0.3)
    for w in waiters:
        w.close()


def test_thousands_of_clients_rendezvous_through_one_server_thread():
    """2,000 clients from 4 processes: publish, read both ring neighbours, store-based barrier."""
    from ferro.testing.store_load import run_store_load

    with Store("127.0.0.1", 0, secret=SECRET, serve=True, timeout=60) as owner:
        run_store_load("ferro", "127.0.0.1", owner.port, 2000, 4, secret=SECRET.decode(), timeout=60)
        assert owner.num_keys() == 2000 + 2  # every address, the barrier's counter and its flag
        assert owner.server.threads == 1


def test_present_says_which_keys_are_set_in_one_request(store):
    store.set("here/a", "1")
    store.set("here/c", "1")
    assert store.present(["here/a", "here/b", "here/c"]) == [True, False, True]
    assert store.present([]) == []
