"""A faithful Kubernetes API emulator on kmock, and the fixtures that run kopf against it.

Only for tests: ``tests/`` is on ``sys.path`` when pytest runs, so test modules import
``k8s.emulator`` and load the fixtures with ``pytest_plugins = ["k8s.fixtures"]``.
"""
