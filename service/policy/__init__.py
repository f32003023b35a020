"""Pure decisions, table-tested, with no I/O and no clock of their own: the admission pass (`admission_pass`, over
`scheduler`'s planning), fair share, quotas, what each end reason means (`end_reasons`), retries, elastic growth,
stalls, reconcile's classification, sweep rules, webhook rules, node exclusion rules and the start-time forecast. May
import `service.core` and `service.spec`."""
