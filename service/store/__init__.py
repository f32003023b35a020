"""The database: tables (`models`, `notify_tables`), engines and sessions (`db`), migrations (Alembic, under
`migrations/`), commit-time wake-ups (`signals`), parsed-spec caches and byte budgets, and the reads admission
shares with the estimate (`standing`). May import `service.core`, `service.spec`, `service.policy` and
`service.config`."""
