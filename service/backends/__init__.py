"""Clusters the dispatcher drives through `service.core.backend.Backend`: Ray (`ray_jobs`; `ray_local` starts a
local head and `ray_start` its nodes; `driver_logs` reads Ray Job logs by range). `noop` and `sim` are stand-ins,
not clusters: `noop` (`SHUNTER_BACKEND=noop:<dir>`) runs nothing and is for the API alone, tests and benchmarks;
`sim` is a simulated cluster for scale and fault benchmarks. May import everything below it, up to lifecycle."""
