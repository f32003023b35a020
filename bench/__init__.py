"""Benchmarks of shunter against the tools a user would pick instead, measured side by side in one run.

Run `python -m bench.run [--quick] [--only NAME]`; results land in bench/results/. Not tests: nothing here asserts
a target, it reports (except correctness facts such as "0 double claims", which fail loudly).
"""
