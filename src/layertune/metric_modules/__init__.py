"""Evaluate metric modules shipped with layertune, loaded by file path so no Hub access is needed.

Each file is a standalone ``evaluate.Metric`` script: ``evaluate.load`` copies it into its modules cache and imports
it from there, so the files must not import each other (evaluate would try to fetch relative imports).
"""
