"""A job's life as the API and the dispatcher write it: state transitions and events (`state`), leases,
progress reports, pre-flight results, node faults, and the use cases the API calls (`jobs`, `queues`, `sweeps`).
May import every folder below it: core, spec, policy, config, store, tenancy, workflows."""
