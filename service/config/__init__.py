"""The service's settings (pydantic-settings, `SHUNTER_*`): parsed and checked here, used everywhere below the
wiring. May import `service.core`, `service.spec` and `service.policy` (for the types of policy settings)."""
