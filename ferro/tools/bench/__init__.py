"""``ferro bench``: the collective benchmark harness (nccl-tests' table, peers side by side).

``ferro.tools.bench.cli`` is the command; ``ferro.tools.bench.worker`` one rank of a sweep;
``ferro.tools.bench.fit`` the cost model ``--fit`` writes;
``ferro.tools.bench.table`` the rows and their formats; ``ferro.tools.bench.plot`` the figure.
"""
