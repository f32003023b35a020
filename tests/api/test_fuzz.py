"""A bounded schemathesis run of the OpenAPI schema over real HTTP (uvicorn) with a real SQLite file: no 5xx but
the documented 503s, and every response conforms to the schema. Ray is at a closed port: nothing here may need it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from service.ray_local import free_port
from service.runtime import Runtime
from tests.api.conftest import offline_settings
from tests.conftest import wait_for

BUDGET_SECONDS = 60.0
EXAMPLES_PER_OPERATION = 60
_started = time.monotonic()


@pytest.fixture(scope="module")
def live_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    runtime = Runtime.open(offline_settings(tmp_path_factory.mktemp("fuzz")))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(runtime=runtime), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=30, what="uvicorn")
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    runtime.close()


# The schema the app serves, built without running it (create_app does no work until its lifespan starts).
SCHEMA = schemathesis.openapi.from_dict(create_app().openapi())
OPERATIONS = {op.label: op for op in (result.ok() for result in SCHEMA.get_all_operations())}


def no_server_error(response: schemathesis.Response, path: str) -> None:
    """Only Ray-backed answers may be 503 (documented, JSON); any other 5xx is a bug."""
    assert response.status_code < 500 or response.status_code == 503, (path, response.status_code, response.text)
    assert "Traceback" not in response.text


def _cases(operation: schemathesis.APIOperation) -> st.SearchStrategy[schemathesis.Case]:
    """Valid requests, and (where the schema allows any) invalid ones: both must get a documented answer."""
    positive = operation.as_strategy(GenerationMode.POSITIVE)
    try:
        return positive | operation.as_strategy(GenerationMode.NEGATIVE)
    except Exception:  # noqa: BLE001 - an operation without parameters or body has no invalid form
        return positive


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_openapi_fuzz(label: str, live_url: str) -> None:
    operation = OPERATIONS[label]

    @given(case=_cases(operation))
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)  # fmt: skip
    def fuzz(case: schemathesis.Case) -> None:
        if time.monotonic() - _started > BUDGET_SECONDS:
            return  # the run is bounded in time: the budget is shared by all operations
        if isinstance(case.query, dict) and str(case.query.get("follow")).lower() in ("true", "1"):
            case.query["timeout_seconds"] = 0.5  # a followed stream must end within the test
        response = case.call(base_url=live_url, timeout=30)
        no_server_error(response, case.path)
        case.validate_response(
            response,
            checks=[
                status_code_conformance,
                content_type_conformance,
                response_schema_conformance,
                response_headers_conformance,
            ],
        )

    fuzz()
