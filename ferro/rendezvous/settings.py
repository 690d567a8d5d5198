"""Where a job's settings come from: the ``FERRO_*`` names, and one parser for each setting.

Every layer reads a timeout, the job secret, the master's port or a rank and
world size through the functions here, so a value is accepted or refused the
same way wherever it enters (an argument, ``init_method``, the environment).
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ferro import environment
from ferro.errors import ConfigurationError, InvalidRankError, InvalidWorldSizeError

__all__ = [
    "BIND_ADDR_ENV",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_TIMEOUT_SECONDS",
    "SECRET_ENV",
    "TIMEOUT_ENV",
    "RendezvousConfig",
    "default_timeout",
    "free_port",
    "job_secret",
    "parse_port",
    "secret_from_env",
    "validate_rank_and_size",
]

TIMEOUT_ENV = "FERRO_TIMEOUT"
SECRET_ENV = "FERRO_SECRET"
BIND_ADDR_ENV = "FERRO_BIND_ADDR"
DEFAULT_TIMEOUT_SECONDS = 60.0
DEFAULT_MASTER_PORT = 29500
# The longest timeout accepted: a week. Longer (or infinite) waits would overflow the
# kernel's and the sockets' time arithmetic, and a job that waits a week is hung.
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0
_LOCALHOST = "127.0.0.1"


def default_timeout(timeout: float | None = None) -> float:
    """Return ``timeout`` if given, else ``$FERRO_TIMEOUT``, else 60 seconds.

    Raises:
        ConfigurationError: The value is not a finite number of seconds in (0, one week].

    """
    source = "timeout"
    if timeout is None:
        raw = environment.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT_SECONDS
        source = f"{TIMEOUT_ENV}={raw!r}"
        try:
            timeout = float(raw)
        except ValueError:
            raise ConfigurationError(f"{source} is not a number of seconds") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) and not hasattr(timeout, "__float__"):
        raise ConfigurationError(f"{source} must be a number of seconds, got {type(timeout).__name__} {timeout!r}")
    seconds = float(timeout)
    if not 0 < seconds <= MAX_TIMEOUT_SECONDS:  # also refuses nan and inf
        raise ConfigurationError(
            f"{source}: a timeout must be a finite number of seconds above 0 and at most {MAX_TIMEOUT_SECONDS:g} "
            f"(one week), got {timeout!r}; ferro never waits without a limit, so give a large number instead")
    return seconds


def secret_from_env(secret: bytes | str | None = None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """Return the job secret as bytes: the argument if given, else ``$FERRO_SECRET``, else None."""
    if secret is None:
        secret = environment.get(SECRET_ENV, environ=environ)
    if secret is None or secret == "" or secret == b"":
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def job_secret(secret: bytes | str | None = None, environ: Mapping[str, str] | None = None) -> bytes:
    """Return the job secret (the argument, else ``$FERRO_SECRET``) as bytes.

    Raises:
        ConfigurationError: Neither gives one.

    """
    found = secret_from_env(secret, environ)
    if found is None:
        raise ConfigurationError(
            f"no job secret: set {SECRET_ENV} to the same random string on every rank "
            f"(`ferro run` does this for you), or pass secret=")
    return found


def parse_port(raw: object, name: str = "MASTER_PORT") -> int:
    """Return ``raw`` (an int, or the text of one) as a TCP port.

    Raises:
        ConfigurationError: Not an integer, or outside 1..65535, naming ``name``.

    """
    if isinstance(raw, bool):
        raise ConfigurationError(f"{name} must be an integer port, got {raw!r}")
    try:
        port = int(raw)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ConfigurationError(f"{name}={raw!r} is not an integer") from None
    if not 0 < port < 65536:
        raise ConfigurationError(f"{name} must be in 1..65535, got {port}")
    return port


def validate_rank_and_size(rank: object, world_size: object) -> tuple[int, int]:
    """Check that ``world_size`` is a positive integer and ``0 <= rank < world_size``.

    Raises:
        InvalidWorldSizeError, InvalidRankError.

    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidWorldSizeError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidRankError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    return rank, world_size


#: Where :func:`free_port` looks first: below Linux's default ephemeral range (32768-60999).
LISTEN_PORTS = range(20000, 32768)


def free_port(host: str = _LOCALHOST) -> int:
    """Return a TCP port that was free on ``host`` a moment ago (another process may take it).

    The port is drawn at random from :data:`LISTEN_PORTS`, outside the range the
    kernel hands out to outgoing connections: a port the kernel chose (``bind(0)``)
    lies in that range, where the job's own connections could take it before the
    store binds it. Falls back to the kernel's choice when no drawn port is free.
    """
    draw = random.SystemRandom()  # not the module's generator: forked ranks would share its state
    ephemeral = _ephemeral_ports()
    for _ in range(32):
        port = draw.choice(LISTEN_PORTS)
        if port in ephemeral:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _ephemeral_ports() -> range:
    """Return the kernel's range for outgoing connections' ports (Linux; empty elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(0)


@dataclass(frozen=True)
class RendezvousConfig:
    """Everything a rank needs to join a job.

    Attributes:
        rank: This process's rank.
        world_size: Number of ranks.
        master_addr: Address of the store (rank 0's host, or the launcher's).
        master_port: Port of the store.
        secret: The job secret shared by every rank.

    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    secret: bytes

    @classmethod
    def resolve(
        cls,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        secret: bytes | str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> RendezvousConfig:
        """Fill unset fields from the environment and validate them all.

        Raises:
            ConfigurationError: A setting is missing or malformed; the message
                names the variable to set.
            InvalidRankError, InvalidWorldSizeError: Out-of-range values.

        """
        env = os.environ if environ is None else environ
        rank_value = rank if rank is not None else _int_from(env, "RANK", "rank")
        size_value = world_size if world_size is not None else _int_from(env, "WORLD_SIZE", "world_size")
        addr = master_addr if master_addr is not None else env.get("MASTER_ADDR")
        if not addr:
            raise ConfigurationError("no master address: set MASTER_ADDR (or pass master_addr=)")
        if master_port is None and not env.get("MASTER_PORT"):
            raise ConfigurationError("master_port is not set: set MASTER_PORT (or pass master_port=)")
        port = parse_port(master_port if master_port is not None else env["MASTER_PORT"])
        secret_bytes = job_secret(secret, env)
        validate_rank_and_size(rank_value, size_value)
        return cls(rank_value, size_value, addr, port, secret_bytes)


def _int_from(env: Mapping[str, str], name: str, argument: str) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        raise ConfigurationError(f"{argument} is not set: set {name} (or pass {argument}=)")
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not an integer") from None

