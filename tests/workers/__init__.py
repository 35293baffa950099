"""What the tests run in other processes: the functions `refimpl.launch.spawn` starts as ranks
(a rank imports its function by module and name, so they cannot live in a test's closure) and
the scripts tests start under torchrun or as a subprocess.

``tests/`` is on ``sys.path`` (pytest inserts the folder of ``tests/conftest.py``), and spawned
ranks inherit the parent's ``sys.path``, so ``workers.<name>`` imports in both."""
