"""shunter's control plane, in folders by role; each folder's `__init__` says what it holds and what it may import.
From the bottom up: `core` (shared vocabulary), `spec` (the job spec), `policy` (pure decisions), `config`
(settings), `store` (the database), `tenancy` (callers, tokens, code), `workflows` (dependencies, notifications,
sweep admission), `lifecycle` (a job's states, progress, and the API's use cases), `backends` (Ray and its
stand-ins), `dispatch` (the dispatcher and its phases). At the top: `runtime` (the wiring), `estimate` and `collectors`.
A folder imports only those below it (tests/service/test_layering.py); docs/architecture.md draws it."""
