"""The job spec and its parts, as users write them: `job` (JobSpec), the strategy, the entrypoint, `depends_on`,
`notify`, and a sweep's request. Pure pydantic models and their checks; what `workers/` reads of a job. May import
`service.core` only."""
