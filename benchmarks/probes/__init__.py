"""Probes: measurements that each settled one design choice (a default, an order, a flush), with no
alternative product to beat. Each module's docstring opens with what it decided and the commit that
decided it; run again, one says whether the choice still holds (``python -m benchmarks.probes.NAME``)."""
