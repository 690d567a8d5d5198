"""The process's descriptor limit: raised to what the system allows, and a clear error when a job needs more.

Every connection is a file descriptor. The soft limit (``ulimit -n``) is often
1,024, below what a store serving a large job, or a rank of one, needs; the hard
limit above it is the process's to take, as MPI launchers and torch's elastic
agent do. Beyond the hard limit only an administrator can help, and the error
says so.
"""

from __future__ import annotations

import resource

from ferro.errors import ConfigurationError

__all__ = ["descriptor_limits", "ensure_descriptors", "raise_descriptor_limit"]


def descriptor_limits() -> tuple[int, int]:
    """Return the process's (soft, hard) RLIMIT_NOFILE (-1 for unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return int(soft), int(hard)


def raise_descriptor_limit() -> int:
    """Raise the soft descriptor limit to the hard one (quietly keeping it where that is refused); return it."""
    soft, hard = descriptor_limits()
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # a hard limit of "unlimited" some kernels refuse as a soft one: keep what we have
    return soft


def ensure_descriptors(needed: int, what: str) -> None:
    """Make sure this process may hold ``needed`` descriptors, raising the soft limit if that helps.

    Raises:
        ConfigurationError: Naming the limit and the fix, when even the hard limit is too low.

    """
    soft = raise_descriptor_limit()
    if soft < 0 or needed <= soft:
        return
    hard = descriptor_limits()[1]
    raise ConfigurationError(
        f"{what} needs about {needed} file descriptors, but this process may hold {soft} (RLIMIT_NOFILE: soft "
        f"{soft}, hard {hard}); raise the hard limit (ulimit -Hn as root, LimitNOFILE= in systemd, nofile in "
        f"/etc/security/limits.conf, or --ulimit nofile= for containers)")
