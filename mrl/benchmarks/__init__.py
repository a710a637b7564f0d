"""The public graders, importable where they were documented before environments got one home each (mrl.envs):
`mrl.benchmarks.bfcl.grade` and `.replay`, `mrl.benchmarks.humaneval.grade`.  Nothing of mrl imports this package.
"""
