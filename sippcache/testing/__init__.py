"""The conformance suite every backend runs unchanged, built-in or third-party.

Subclass `BackendTests` in a test module and give it one fixture, `cache_url`,
returning the URL of a fresh, empty store (the backend must be installed, so
its entry point resolves, or registered with `sippcache.register_backend`).
Persistent backends also mix in `PersistentBackendTests`::

    import pytest
    from sippcache.testing import BackendTests, PersistentBackendTests

    class TestMyBackend(PersistentBackendTests, BackendTests):
        @pytest.fixture
        def cache_url(self, tmp_path):
            return f"mybackend://{tmp_path}/store"

`BackendTests` unites one mixin per concern (`StoreTests`, `PrefixTests`,
`NamespaceTests`, `InputTests`, `EvictionTests`, `PinTests`, `GenerationTests`,
`StatsTests`, `ThreadTests`) and `PersistentBackendTests` three (`ReopenTests`,
`SharedStoreTests`, `ProcessTests`). Each mixin carries the fixtures, so one
alone, with a `cache_url`, runs a subset: ``class TestMyPrefixes(PrefixTests)``.

The suite opens stores through `sippcache.open`, so the URL scheme, the
entry point and the shared options (`max_bytes`, `max_entries`) are tested
too. Needs pytest (and numpy for the array-type test).

Every wait in the suite is bounded (a hang is never a test result): the helpers,
for a backend's own tests too, are in `sippcache.testing.bounded`.
"""

from __future__ import annotations

from .eviction import EvictionTests
from .fixtures import BackendFixtures, Opener
from .generations import GenerationTests
from .inputs import InputTests
from .namespaces import NamespaceTests
from .persistence import ReopenTests
from .pins import PinTests
from .prefixes import PrefixTests
from .processes import ProcessTests, run_in_child
from .sharing import SharedStoreTests
from .stats import StatsTests
from .store import StoreTests
from .threads import ThreadTests

__all__ = [
    "BackendFixtures",
    "BackendTests",
    "EvictionTests",
    "GenerationTests",
    "InputTests",
    "NamespaceTests",
    "Opener",
    "PersistentBackendTests",
    "PinTests",
    "PrefixTests",
    "ProcessTests",
    "ReopenTests",
    "SharedStoreTests",
    "StatsTests",
    "StoreTests",
    "ThreadTests",
    "run_in_child",
]


class BackendTests(
    StoreTests,
    PrefixTests,
    NamespaceTests,
    InputTests,
    EvictionTests,
    PinTests,
    GenerationTests,
    StatsTests,
    ThreadTests,
):
    """Behaviour every `CacheBackend` must have. Provide the `cache_url` fixture."""


class PersistentBackendTests(ReopenTests, SharedStoreTests, ProcessTests):
    """Extra behaviour for backends whose `persistent` is True: mix into `BackendTests`."""
