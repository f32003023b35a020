"""The anchor of the submission benchmark: a bare FastAPI JSON endpoint under the same uvicorn settings as
`shunter api` (uvicorn.run(app, host, port, log_level="info")). `python -m bench.bare_app PORT`"""

from __future__ import annotations

import sys
import uuid
from typing import Any

from fastapi import FastAPI

app = FastAPI()


@app.post("/v1/jobs", status_code=201)
def submit(body: dict[str, Any]) -> dict[str, Any]:
    return {"id": uuid.uuid4().hex[:12], "state": "QUEUED", "spec": body}


@app.get("/readyz")
def readyz() -> dict[str, bool]:
    return {"ready": True}


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="info")
