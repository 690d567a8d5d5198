"""The job launcher behind ``ferro run`` (also ``python -m ferro.run``).

``ferro.launch.agent`` runs a node's ranks; ``ferro.launch.cli`` parses the
command line; ``ferro.launch.bootstrap`` is what each rank runs first. This
package imports none of them itself, so ``python -m ferro.launch.bootstrap``
starts cleanly.
"""
