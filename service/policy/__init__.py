"""Pure decisions, table-tested, with no I/O and no clock of their own: admission planning (`scheduler`),
fair share, quotas, retries, elastic growth, stalls, reconcile's classification, sweep rules, webhook rules, node
exclusion rules and the start-time forecast. May import `service.core` and `service.spec`."""
