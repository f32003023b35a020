"""The fix this suite proposes for the worst ratio (claims/s), measured without editing service/: a Dispatcher whose
admission pass (1) batches its writes under the admission lock and (2) hands the admitted jobs' submissions to its
reconcile pool instead of submitting them one by one.

Proposed diff (service/dispatcher.py, Dispatcher.admit):

             by_id = {job.id: job for job in waiting}
    -        for job_id in decision.admit:
    +        # Under the admission lock every round trip is paid by every dispatcher: without autoflush the loop's
    +        # JobEvent and Attempt rows go in as two batched INSERTs at commit, not two INSERTs per admitted job.
    +        with session.no_autoflush:
    +          for job_id in decision.admit:
                 ...
    -        for job in started:
    -            self.reconcile(job)  # submit at once rather than on the next tick
    +        # Submit at once rather than on the next tick, overlapped like every other reconcile (each is a few
    +        # database round trips and a Ray call).
    +        list(self._pool.map(self._reconcile_safely, started))

`python -m bench.patched` runs a dispatcher loop like `shunter dispatcher`, with both changes (emulated: admit's
session runs without autoflush, and the reconcile calls admit makes are deferred to the pool).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import service.dispatcher as dispatcher_module
from service.dispatcher import Dispatcher

_session_scope = dispatcher_module.session_scope


@contextlib.contextmanager
def _scope_without_autoflush(engine: Any) -> Iterator[Any]:
    with _session_scope(engine) as session, session.no_autoflush:
        yield session


class PooledAdmitDispatcher(Dispatcher):
    """Dispatcher.admit with the proposed changes."""

    def admit(self, cluster: Any) -> list[str]:
        self._deferred: list[Any] = []
        self._deferring = True
        # Only admit's own transaction is affected: the reconcile pool is idle while admit runs (see tick()).
        dispatcher_module.session_scope = _scope_without_autoflush
        try:
            admitted = super().admit(cluster)
        finally:
            dispatcher_module.session_scope = _session_scope
            self._deferring = False
        list(self._pool.map(self._reconcile_safely, self._deferred))
        return admitted

    def reconcile(self, job: Any) -> None:
        if getattr(self, "_deferring", False):
            self._deferred.append(job)
            return
        super().reconcile(job)


def main() -> None:
    import logging

    from service.runtime import run_dispatcher_process

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_dispatcher_process(PooledAdmitDispatcher)


if __name__ == "__main__":
    main()
