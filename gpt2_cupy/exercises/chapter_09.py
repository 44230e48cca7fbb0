"""Chapter 09's graded exercises."""

EXERCISES = []
