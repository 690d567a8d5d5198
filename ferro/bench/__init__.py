"""``ferro bench``: the collective benchmark harness (nccl-tests' table, peers side by side).

``ferro.bench.cli`` is the command; ``ferro.bench.worker`` one rank of a sweep;
``ferro.bench.table`` the rows and their formats; ``ferro.bench.plot`` the figure.
"""
