"""Acceptance tests: marked ``acceptance``; the tiny models built once a session."""

from pathlib import Path

import pytest
from harness import MODELS, REPORT


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "acceptance: drives the real command-line fronts (make acceptance)"
    )


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.acceptance)


@pytest.fixture(scope="session")
def model_dir(make_tiny_dir):
    """``model_dir(name) -> Path`` of one of ``MODELS``, built once a session."""

    def get(name):
        family, overrides = MODELS[name]
        return make_tiny_dir(family, **overrides)

    return get


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("acceptance measurements")
        for line in REPORT:
            terminalreporter.write_line(line)
