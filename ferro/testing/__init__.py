"""A multi-rank test harness for ferro and for code built on it.

:func:`run_processes` runs one function on N ranks as processes over real
sockets; :func:`run_threads` runs it on N simulated ranks as threads. Both
return every rank's result, ship tracebacks back, stop the other ranks at the
first failure and enforce a timeout that reports the stacks of hung ranks.
"""

from ferro.testing.processes import RankExit, run_processes
from ferro.testing.threads import run_threads

__all__ = ["RankExit", "run_processes", "run_threads"]
