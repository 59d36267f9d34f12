from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server_harness import ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One shared real server for the tests that only send requests."""
    srv = ServerProcess(tmp_path_factory.mktemp("shared-server") / "tmp").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> Iterator[openai.OpenAI]:
    """The official openai client on the shared server."""
    with server.openai_client() as c:
        yield c


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--lifecycles",
        default="10000",
        help="lifecycles for the differential test (the suite runs 10,000; 20,000 on request)",
    )
    parser.addoption("--lifecycle-seed", default="0", help="first seed of the differential test")
