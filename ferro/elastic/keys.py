"""The store keys of an elastic job: one place, read by the ranks and written by ``ferro run``'s agent.

Every key lives under ``ferro/elastic/`` on the job's store, which ``ferro run
--restart-policy rank`` serves from its agent so that it outlives any rank.

* ``dead/<member>``: the agent's record that a member's process ended (its words: "was killed by SIGKILL"),
  and ``deaths``: a counter of those records (what the ranks' watchers poll).
* ``join/count`` and ``join/<k>``: replacements that asked to join, in order.
* ``<epoch>/invited``: which join requests an epoch admits (JSON, first proposal wins).
* ``<epoch>/here/<member>``: a member arrived at the epoch's rendezvous.
* ``<epoch>/members``: the epoch's members in rank order (JSON, decided once by compare-and-set).
* ``<epoch>/group/...``: the epoch's own process group (a scoped view: addresses, claims).
* ``finished`` / ``failed``: how the job ended.
* ``agent-done/<node>``: another node's agent has read the outcome (the serving agent waits for it before closing).
* ``node-errors/<node>``: at its end, another node's ranks that failed by their own error (the first node's
  exit status counts them).
* ``agent-beat/<node>``: a counter another node's agent bumps while it lives (its lease; see
  :mod:`ferro.launch.in_place`), and ``node-members/<node>``: that node's current members (JSON).
"""

from __future__ import annotations

__all__ = ["ROOT", "agent_beat", "agent_done", "dead", "deaths", "epoch", "failed", "finished", "join_count",
           "join_request", "node_errors", "node_members"]

ROOT = "ferro/elastic"


def dead(member: str) -> str:
    """Return the key the agent sets when ``member``'s process has ended."""
    return f"{ROOT}/dead/{member}"


def deaths() -> str:
    """Return the counter the agents add one to with every ``dead/<member>`` they write."""
    return f"{ROOT}/deaths"


def join_count() -> str:
    """Return the key counting join requests."""
    return f"{ROOT}/join/count"


def join_request(index: int) -> str:
    """Return the key holding the member id of join request ``index`` (0-based)."""
    return f"{ROOT}/join/{index}"


def epoch(number: int, name: str) -> str:
    """Key ``name`` of epoch ``number`` (``epoch(3, "members")``)."""
    return f"{ROOT}/{number}/{name}"


def finished() -> str:
    """Return the key set when training has completed its last step."""
    return f"{ROOT}/finished"


def failed() -> str:
    """Return the key set, with the reason, when the job stopped below its minimum size."""
    return f"{ROOT}/failed"


def agent_done(node: int) -> str:
    """Return the key node ``node``'s agent sets once it no longer needs the store."""
    return f"{ROOT}/agent-done/{node}"


def agent_beat(node: int) -> str:
    """Return the counter node ``node``'s agent increments while it lives."""
    return f"{ROOT}/agent-beat/{node}"


def node_errors(node: int) -> str:
    """Return the key holding node ``node``'s ranks that failed by an error of their own (JSON list, at its end)."""
    return f"{ROOT}/node-errors/{node}"


def node_members(node: int) -> str:
    """Return the key holding node ``node``'s current member ids (JSON list)."""
    return f"{ROOT}/node-members/{node}"
