"""The command line: ``ferro`` (:mod:`.cli`), ``ferro run`` (:mod:`.run`), ``ferro demo`` and ``ferro bench``.

Nothing here is imported by ``import ferro``; the launcher's own machinery is
:mod:`ferro.launch`.
"""
