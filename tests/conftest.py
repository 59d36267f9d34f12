from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server_harness import ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One shared real server for the tests that only send requests."""
    srv = ServerProcess(tmp_path_factory.mktemp("shared-server") / "tmp").wait_ready()
    yield srv
    srv.stop()
