"""
The plumbing around a run, which a first reading of the paper's files can skip: flags and
one-line errors (cli), run folders, checkpoints and locks (runs), whether a result is of
what it says (provenance), whole-or-absent files (files), torchrun's process group
(processes). It imports nothing of the project outside itself: the paper's files use it,
never the other way round.
"""
