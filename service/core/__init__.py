"""The vocabulary every part of the control plane shares: errors, the job states and end reasons, the clock,
number fields that mean what they say, resource arithmetic, storage locations, and the `Backend` protocol (what a
cluster is to the service, with its value types). Imports nothing of shunter's; `workers/` may import it."""
