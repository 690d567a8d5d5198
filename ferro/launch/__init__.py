"""The job launcher behind ``ferro run`` (also ``python -m ferro run``).

``ferro.launch.agent`` runs a node's ranks; ``ferro.tools.run`` parses the
command line; ``ferro.launch.bootstrap`` is what each rank runs first (by its
file path, so that nothing in the launcher's working directory can shadow the
installed ferro). This package imports none of them itself.
"""
