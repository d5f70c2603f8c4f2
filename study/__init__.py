"""
The toy study's machinery, beside the paper's files: the synthetic world (world), the
model organism pretrained on it (organism), the report (report), the readings by the rules
written before the runs (readings), the frontier study (frontier) and the figures
(figures). reproduce.py, toy.py and results.py are its commands.
"""
